/* dpsync-info: the command line (usage, options). */
#define _GNU_SOURCE
#include "dpsync_info.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(FILE *out) {
  fprintf(out,
          "usage: dpsync-info [--cuda ORDINALS | --host N] [--transport auto|nccl|peer_copy|host]\n"
          "                   [--peer-access MATRIX] [--fusion-bytes N] [--check] [--json]\n"
          "  --cuda 0,0,1         one CUDA replica per entry (device ordinals, may repeat)\n"
          "  --host N             N host replicas\n"
          "                       (neither: one CUDA replica per GPU found, else --host 2)\n"
          "  --peer-access M      override peer access between replicas: rows split by '/',\n"
          "                       entries 0 or 1 split by ',', e.g. 1,0,0/0,1,1/0,1,1\n"
          "  --fusion-bytes N     fusion bucket capacity (0: no fusion)\n"
          "  --check              also create a context with these options and show what dpsync\n"
          "                       chose, or its error (exit 1)\n"
          "  --json               one JSON object instead of tables (\"plan\": dpsync_plan_describe's)\n");
}

void bad_usage(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("dpsync-info: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputs("\n", stderr);
  va_end(ap);
  usage(stderr);
  exit(2);
}

/* ------------------------------------------------------------------ options */

static int parse_size(const char *text, size_t *out) {
  char *end = NULL;
  if (!text || !isdigit((unsigned char)*text)) return 0;
  errno = 0;
  unsigned long long v = strtoull(text, &end, 10);
  if (errno || *end || v > SIZE_MAX) return 0;
  *out = (size_t)v;
  return 1;
}

static void parse_cuda(const char *text, args *a) {
  a->cuda_n = 0;
  const char *p = text;
  for (;;) {
    char *end = NULL;
    if (!isdigit((unsigned char)*p)) bad_usage("--cuda %s: expected device ordinals like 0,0,1", text);
    errno = 0;
    long v = strtol(p, &end, 10);
    if (errno || v > INT32_MAX || a->cuda_n == MAX_REPLICAS)
      bad_usage("--cuda %s: an ordinal or the count is out of range", text);
    a->cuda[a->cuda_n++] = (int32_t)v;
    if (*end == '\0') return;
    if (*end != ',') bad_usage("--cuda %s: expected device ordinals like 0,0,1", text);
    p = end + 1;
  }
}

/* "1,0,0/0,1,1/0,1,1": rows split by '/', 0 or 1 split by ','; must be square. */
static void parse_peer(const char *text, args *a) {
  size_t rows = 1, entries = 0, row_len = 0, first_len = 0;
  for (const char *p = text; *p; p++) {
    if (*p == '0' || *p == '1') {
      entries++, row_len++;
      if (p[1] != '\0' && p[1] != ',' && p[1] != '/') goto bad;
    } else if (*p == '/') {
      if (rows == 1) first_len = row_len;
      if (row_len == 0 || row_len != first_len) goto bad;
      rows++, row_len = 0;
    } else if (*p != ',' || p == text || p[1] == '\0' || p[1] == ',' || p[1] == '/') {
      goto bad;
    }
  }
  if (rows == 1) first_len = row_len;
  if (row_len != first_len || rows != first_len || entries == 0) goto bad;
  a->peer = malloc(entries);
  if (!a->peer) exit(1);
  a->peer_n = rows;
  size_t k = 0;
  for (const char *p = text; *p; p++)
    if (*p == '0' || *p == '1') a->peer[k++] = (uint8_t)(*p - '0');
  return;
bad:
  bad_usage("--peer-access %s: expected a square 0/1 matrix like 1,0,0/0,1,1/0,1,1", text);
}

void append(char *buf, size_t cap, const char *fmt, ...) {
  size_t used = strlen(buf);
  if (used + 1 >= cap) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf + used, cap - used, fmt, ap);
  va_end(ap);
}

void parse_args(int argc, char **argv, args *a) {
  static const char *const transports[] = {"auto", "nccl", "peer_copy", "host"};
  for (int i = 1; i < argc; i++) {
    const char *o = argv[i];
    if (strcmp(o, "-h") == 0 || strcmp(o, "--help") == 0) {
      usage(stdout);
      exit(0);
    }
    if (strcmp(o, "--check") == 0) {
      a->check = 1;
      continue;
    }
    if (strcmp(o, "--json") == 0) {
      a->json = 1;
      continue;
    }
    const char *v = i + 1 < argc ? argv[++i] : NULL;
    if (strcmp(o, "--cuda") == 0 || strcmp(o, "--host") == 0 || strcmp(o, "--transport") == 0 ||
        strcmp(o, "--peer-access") == 0 || strcmp(o, "--fusion-bytes") == 0) {
      if (!v) bad_usage("%s needs a value", o);
    } else {
      bad_usage("unknown argument '%s'", o);
    }
    if (strcmp(o, "--cuda") == 0) {
      parse_cuda(v, a);
    } else if (strcmp(o, "--host") == 0) {
      if (!parse_size(v, &a->host_n) || a->host_n == 0) bad_usage("--host %s: expected N >= 1", v);
    } else if (strcmp(o, "--transport") == 0) {
      size_t t = 0;
      while (t < 4 && strcmp(v, transports[t]) != 0) t++;
      if (t == 4) bad_usage("--transport %s: expected auto, nccl, peer_copy or host", v);
      a->have_transport = 1;
      a->transport = (uint32_t)t; /* DPSYNC_TRANSPORT_AUTO..HOST are 0..3 in this order */
    } else if (strcmp(o, "--peer-access") == 0) {
      free(a->peer);
      parse_peer(v, a);
      a->peer_text = v;
    } else {
      if (!parse_size(v, &a->fusion_bytes)) bad_usage("--fusion-bytes %s: expected N >= 0", v);
      a->have_fusion = 1;
    }
    if (strcmp(o, "--cuda") == 0) a->host_n = 0;
    if (strcmp(o, "--host") == 0) a->cuda_n = 0;
  }
}
