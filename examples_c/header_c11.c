/* Proves include/dpsync.h compiles as strict C11 with -Wall -Wextra -Wpedantic -Werror, and links. */
#include <dpsync.h>

#include <stdio.h>
#include <string.h>

_Static_assert(DPSYNC_STATUS_OK == 0, "DPSYNC_STATUS_OK");
_Static_assert(DPSYNC_ROLE_PARAM == 1 && DPSYNC_ROLE_STATE == 8, "role bits");
_Static_assert(DPSYNC_DTYPE_I64 == 5, "DPSYNC_DTYPE_I64");

int main(void) {
  dpsync_status (*create)(const dpsync_options *, dpsync_context **) = dpsync_context_create;
  dpsync_options *opts = NULL;
  dpsync_context *ctx = NULL;
  uint32_t roles = DPSYNC_ROLE_PARAM | DPSYNC_ROLE_STATE;
  dpsync_dtype dtype = DPSYNC_DTYPE_F32;
  dpsync_transport transport = DPSYNC_TRANSPORT_HOST;
  dpsync_reduce_op op = DPSYNC_REDUCE_AVG;

  printf("dpsync version %s (C11)\n", dpsync_version());
  if (dpsync_options_new(&opts) != DPSYNC_STATUS_OK || dpsync_options_set_transport(opts, transport) != DPSYNC_STATUS_OK ||
      create(opts, &ctx) != DPSYNC_STATUS_OK) {
    fprintf(stderr, "setup failed: %s\n", dpsync_last_error());
    return 1;
  }
  float x[2] = {1.0f, 2.0f};
  if (dpsync_register(ctx, "x", DPSYNC_ROLE_PARAM, 0, x, 2, dtype) != DPSYNC_STATUS_OK ||
      dpsync_broadcast(ctx, roles, 0) != DPSYNC_STATUS_OK || dpsync_allreduce(ctx, "x", op) != DPSYNC_STATUS_OK) {
    fprintf(stderr, "collective failed: %s\n", dpsync_last_error());
    return 1;
  }
  printf("%s\n", dpsync_status_name(DPSYNC_STATUS_NOT_FOUND));
  dpsync_context_destroy(ctx);
  dpsync_options_free(opts);
  return strcmp(dpsync_status_name(DPSYNC_STATUS_OK), "DPSYNC_STATUS_OK") == 0 ? 0 : 1;
}
