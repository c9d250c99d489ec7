/*
 * checkpoint_sync — resuming data-parallel training from a checkpoint loaded on one replica.
 *
 * Four host replicas hold parameters (PARAM), optimizer momentum and the iteration counter ITER
 * (STATE, ITER is int64) and batch-norm running statistics (COMPUTED). Only replica 2 "loads the
 * checkpoint"; the others hold garbage. Broadcasting PARAM|STATE from replica 2 must give every
 * replica replica 2's bytes without touching the COMPUTED tensors, which are then averaged.
 * Along the way: a duplicate identical registration is a no-op, a conflicting one is refused,
 * and bad calls fail with INVALID_ARGUMENT and change nothing.
 */
#include <dpsync.h>

#include "example_util.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { NREP = 4, ROOT = 2, NW = 12, NB = 3, NC = 3 };

typedef struct {
  float fc_w[NW];
  float fc_b[NB];
  float fc_w_momentum[NW];
  float fc_b_momentum[NB];
  int64_t iter[1];
  float bn_running_mean[NC];
  float bn_running_var[NC];
} replica_t;

static const struct {
  const char *name;
  uint32_t role;
  size_t offset;
  size_t count;
  uint32_t dtype;
  size_t bytes;
} TENSORS[] = {
    {"fc_w", DPSYNC_ROLE_PARAM, offsetof(replica_t, fc_w), NW, DPSYNC_DTYPE_F32, sizeof(float) * NW},
    {"fc_b", DPSYNC_ROLE_PARAM, offsetof(replica_t, fc_b), NB, DPSYNC_DTYPE_F32, sizeof(float) * NB},
    {"fc_w_momentum", DPSYNC_ROLE_STATE, offsetof(replica_t, fc_w_momentum), NW, DPSYNC_DTYPE_F32,
     sizeof(float) * NW},
    {"fc_b_momentum", DPSYNC_ROLE_STATE, offsetof(replica_t, fc_b_momentum), NB, DPSYNC_DTYPE_F32,
     sizeof(float) * NB},
    {"ITER", DPSYNC_ROLE_STATE, offsetof(replica_t, iter), 1, DPSYNC_DTYPE_I64, sizeof(int64_t)},
    {"bn_running_mean", DPSYNC_ROLE_COMPUTED, offsetof(replica_t, bn_running_mean), NC, DPSYNC_DTYPE_F32,
     sizeof(float) * NC},
    {"bn_running_var", DPSYNC_ROLE_COMPUTED, offsetof(replica_t, bn_running_var), NC, DPSYNC_DTYPE_F32,
     sizeof(float) * NC},
};
enum { N_TENSORS = sizeof(TENSORS) / sizeof(TENSORS[0]) };

static replica_t reps[NREP];
static int failures = 0, passes = 0;


static void verify(int ok, const char *what) {
  printf("%s: %s\n", ok ? "ok  " : "FAIL", what);
  if (ok)
    passes++;
  else
    failures++;
}

static unsigned char *field(replica_t *r, int t) { return (unsigned char *)r + TENSORS[t].offset; }

/* A failing call must return `expected` with a message that names `culprit`. */
static void expect_failure(dpsync_status got, dpsync_status expected, const char *culprit, const char *what) {
  char line[512];
  const char *msg = dpsync_last_error();
  snprintf(line, sizeof line, "%s -> %s (\"%s\")", what, dpsync_status_name((uint32_t)got), msg);
  verify(got == expected && strstr(msg, culprit) != NULL, line);
}

int main(void) {
  dpsync_options *opts = NULL;
  dpsync_context *ctx = NULL;
  CHECK(dpsync_options_new(&opts));
  CHECK(dpsync_options_set_host_replicas(opts, NREP));
  CHECK(dpsync_context_create(opts, &ctx));
  dpsync_options_free(opts);

  size_t count = 0;
  double scale = 0.0;
  CHECK(dpsync_replica_count(ctx, &count));
  CHECK(dpsync_loss_scale(ctx, &scale));
  verify(count == NREP && scale == 1.0 / NREP, "4 host replicas, loss scale 0.25");

  /* Replica 2 loads the checkpoint; the others hold different garbage (as after a fresh init). */
  for (int r = 0; r < NREP; r++) {
    replica_t *p = &reps[r];
    int ck = r == ROOT;
    for (int i = 0; i < NW; i++) {
      p->fc_w[i] = ck ? 0.125f * (float)(i + 1) : -1000.0f * (float)(r + 1) - (float)i;
      p->fc_w_momentum[i] = ck ? -0.01f * (float)i : 7.0f * (float)(r + 1);
    }
    for (int i = 0; i < NB; i++) {
      p->fc_b[i] = ck ? 0.5f - (float)i : 1e6f * (float)(r + 1);
      p->fc_b_momentum[i] = ck ? 0.001f * (float)(i + 1) : (float)(-r);
    }
    p->iter[0] = ck ? INT64_C(123456789012) : -(int64_t)(r + 1);
    /* Every replica has its own running statistics (each saw different batches). */
    for (int i = 0; i < NC; i++) {
      p->bn_running_mean[i] = 0.1f * (float)(r + 1) + 0.3f * (float)i;
      p->bn_running_var[i] = 1.0f + 0.7f * (float)r * (float)(i + 1);
    }
  }
  replica_t original[NREP];
  memcpy(original, reps, sizeof reps);

  for (int r = 0; r < NREP; r++)
    for (int t = 0; t < N_TENSORS; t++)
      CHECK(dpsync_register(ctx, TENSORS[t].name, TENSORS[t].role, (size_t)r, field(&reps[r], t),
                            TENSORS[t].count, TENSORS[t].dtype));

  /* Duplicate initialiser: the identical registration again is a no-op. */
  dpsync_status st = dpsync_register(ctx, "fc_w", DPSYNC_ROLE_PARAM, 1, reps[1].fc_w, NW, DPSYNC_DTYPE_F32);
  verify(st == DPSYNC_STATUS_OK, "registering 'fc_w' on replica 1 a second time, identically -> OK");
  /* The same name with another count on the same replica is a conflict and changes nothing. */
  st = dpsync_register(ctx, "fc_w", DPSYNC_ROLE_PARAM, 1, reps[1].fc_w, NW - 1, DPSYNC_DTYPE_F32);
  expect_failure(st, DPSYNC_STATUS_CONFLICT, "fc_w", "re-registering 'fc_w' on replica 1 with 11 elements");

  /* Bad calls, while the replicas still differ, so any byte they moved would show. */
  st = dpsync_broadcast(ctx, DPSYNC_ROLE_PARAM | DPSYNC_ROLE_STATE, 7);
  expect_failure(st, DPSYNC_STATUS_INVALID_ARGUMENT, "root_replica", "broadcast from root_replica 7");
  st = dpsync_average(ctx, 0);
  expect_failure(st, DPSYNC_STATUS_INVALID_ARGUMENT, "roles", "average with an empty roles mask");
  st = dpsync_average(ctx, 0x10);
  expect_failure(st, DPSYNC_STATUS_INVALID_ARGUMENT, "roles", "average with unknown role bit 0x10");
  verify(memcmp(original, reps, sizeof reps) == 0, "the failed calls changed no byte on any replica");

  CHECK(dpsync_broadcast(ctx, DPSYNC_ROLE_PARAM | DPSYNC_ROLE_STATE, ROOT));
  int same = 1, untouched = 1;
  for (int r = 0; r < NREP; r++) {
    for (int t = 0; t < N_TENSORS; t++) {
      const unsigned char *now = field(&reps[r], t);
      if (TENSORS[t].role == DPSYNC_ROLE_COMPUTED)
        untouched &= memcmp(now, field(&original[r], t), TENSORS[t].bytes) == 0;
      else
        same &= memcmp(now, field(&original[ROOT], t), TENSORS[t].bytes) == 0;
    }
  }
  verify(same, "broadcast(PARAM|STATE, 2): every replica holds replica 2's params, momentum and ITER bytes");
  verify(reps[0].iter[0] == INT64_C(123456789012) && reps[3].iter[0] == INT64_C(123456789012),
         "ITER (int64) restored to 123456789012 on every replica");
  verify(untouched, "broadcast(PARAM|STATE, 2) left the COMPUTED tensors (BN statistics) untouched");

  replica_t after_broadcast[NREP];
  memcpy(after_broadcast, reps, sizeof reps);
  CHECK(dpsync_average(ctx, DPSYNC_ROLE_COMPUTED));
  int close = 1, identical = 1, others_kept = 1;
  double worst = 0.0;
  for (int t = 0; t < N_TENSORS; t++) {
    if (TENSORS[t].role != DPSYNC_ROLE_COMPUTED) {
      for (int r = 0; r < NREP; r++)
        others_kept &= memcmp(field(&reps[r], t), field(&after_broadcast[r], t), TENSORS[t].bytes) == 0;
      continue;
    }
    for (size_t i = 0; i < TENSORS[t].count; i++) {
      double mean = 0.0;
      for (int r = 0; r < NREP; r++) mean += ((const float *)field(&original[r], t))[i];
      mean /= NREP;
      for (int r = 0; r < NREP; r++) {
        double got = ((const float *)field(&reps[r], t))[i];
        double err = fabs(got - mean);
        if (err > worst) worst = err;
        close &= err <= 1e-6 * (1.0 + fabs(mean));
      }
    }
    for (int r = 1; r < NREP; r++) identical &= memcmp(field(&reps[r], t), field(&reps[0], t), TENSORS[t].bytes) == 0;
  }
  char line[160];
  snprintf(line, sizeof line, "average(COMPUTED): BN statistics equal the mean of the 4 replicas (max |err| %.2g)",
           worst);
  verify(close, line);
  verify(identical, "average(COMPUTED): BN statistics bytewise identical on every replica");
  verify(others_kept, "average(COMPUTED) left PARAM and STATE tensors untouched");

  CHECK(dpsync_context_destroy(ctx));
  printf("checkpoint_sync: %d checks passed, %d failed\n", passes, failures);
  return failures == 0 ? 0 : 1;
}
