/*
 * A program built against an installed dpsync, as a user builds one: scripts/check-install.sh
 * builds it with CMake's find_package (shared and static), with pkg-config, and statically with
 * pkg-config --static. Two host replicas, one allreduce, exact sums, and the header's version
 * macros against the library's dpsync_version(). Prints "ok" and exits 0 when all agree.
 */
#include <dpsync.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call)                                                                       \
  do {                                                                                    \
    dpsync_status s_ = (call);                                                            \
    if (s_ != DPSYNC_STATUS_OK) {                                                         \
      fprintf(stderr, "%s failed: %s: %s\n", #call, dpsync_status_name((uint32_t)s_),     \
              dpsync_last_error());                                                       \
      return 1;                                                                           \
    }                                                                                     \
  } while (0)

int main(void) {
  char header[64];
  snprintf(header, sizeof header, "%d.%d.%d", DPSYNC_VERSION_MAJOR, DPSYNC_VERSION_MINOR,
           DPSYNC_VERSION_PATCH);
  const char *library = dpsync_version();
  printf("dpsync %s (header %s)\n", library, header);
  /* The library's version may carry a pre-release suffix ("0.2.0-rc.1") after the numbers. */
  size_t n = strlen(header);
  if (strncmp(library, header, n) != 0 || (library[n] && library[n] != '-' && library[n] != '+')) {
    fprintf(stderr, "the header is %s but the library is %s\n", header, library);
    return 1;
  }

  dpsync_options *options = NULL;
  dpsync_context *ctx = NULL;
  CHECK(dpsync_options_new(&options));
  CHECK(dpsync_options_set_host_replicas(options, 2));
  CHECK(dpsync_context_create(options, &ctx));
  dpsync_options_free(options);

  float w[2][4] = {{1, 2, 3, 4}, {10, 20, 30, 40}};
  for (size_t r = 0; r < 2; r++)
    CHECK(dpsync_register(ctx, "w_grad", DPSYNC_ROLE_GRAD, r, w[r], 4, DPSYNC_DTYPE_F32));
  CHECK(dpsync_allreduce_grads(ctx, DPSYNC_REDUCE_SUM));
  for (size_t r = 0; r < 2; r++)
    for (size_t i = 0; i < 4; i++)
      if (w[r][i] != 11.0f * (float)(i + 1)) {
        fprintf(stderr, "replica %zu element %zu is %g, expected %g\n", r, i, w[r][i],
                11.0 * (double)(i + 1));
        return 1;
      }
  CHECK(dpsync_context_destroy(ctx));
  printf("allreduce of 2 host replicas: ok\n");
  return 0;
}
