/* Helpers shared by the C examples: a status check that names the failing call, and strict
 * command-line number parsing (the whole text must be a number, in range; a size may not be
 * negative). */
#ifndef DPSYNC_EXAMPLE_UTIL_H
#define DPSYNC_EXAMPLE_UTIL_H

#include <dpsync.h>

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* Exits with the call, its status and dpsync's message unless the status is OK. */
static inline void check_status(dpsync_status status, const char *call, const char *file, int line) {
  if (status != DPSYNC_STATUS_OK) {
    fprintf(stderr, "%s:%d: %s failed: %s: %s\n", file, line, call,
            dpsync_status_name((uint32_t)status), dpsync_last_error());
    exit(1);
  }
}
#define CHECK(call) check_status((call), #call, __FILE__, __LINE__)

static inline int parse_size(const char *text, size_t *out) {
  char *end = NULL;
  if (text == NULL || *text == '\0' || *text == '-') return 0;
  errno = 0;
  unsigned long long v = strtoull(text, &end, 10);
  if (errno != 0 || *end != '\0' || v > SIZE_MAX) return 0;
  *out = (size_t)v;
  return 1;
}

static inline int parse_double(const char *text, double *out) {
  char *end = NULL;
  if (text == NULL || *text == '\0') return 0;
  errno = 0;
  double v = strtod(text, &end);
  if (errno != 0 || *end != '\0' || !isfinite(v)) return 0;
  *out = v;
  return 1;
}

#endif
