/*
 * zero_train — the dense demo model trained with Adam on N host replicas, twice: once with the
 * optimizer state whole on every replica (dpsync_allreduce_grads, then every replica updates
 * every parameter), once sharded as ZeRO stage 1 does (dpsync_reduce_scatter_grads, each replica
 * updates only the pieces dpsync_shard says it owns with state sized for them, then
 * dpsync_allgather of the parameters). Prints the optimizer-state bytes per replica both ways
 * and the largest difference between the two runs' final weights, which must be 0: both sum
 * every gradient element in the same order.
 *
 *   zero_train [--replicas N] [--steps S] [--batch B] [--lr LR] [--describe]
 *              [--save FILE] [--expect FILE --tol T]
 */
#include <dpsync.h>

#include "dense_model.h"
#include "example_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(void) {
  fprintf(stderr, "usage: zero_train [--replicas N] [--steps S] [--batch B] [--lr LR] [--describe]\n"
                  "                  [--save FILE] [--expect FILE --tol T]\n"
                  "  B is the global batch and must be a multiple of N.\n");
  exit(2);
}

/* Adam's state for `count` elements of one tensor on one replica. */
typedef struct {
  float *m, *v;
  size_t offset, count;
} adam_t;

static void adam_step(float *p, const float *g, adam_t *a, double lr, int t) {
  const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
  const float c1 = 1.0f - powf(b1, (float)t), c2 = 1.0f - powf(b2, (float)t);
  for (size_t i = 0; i < a->count; i++) {
    size_t k = a->offset + i;
    a->m[i] = b1 * a->m[i] + (1.0f - b1) * g[k];
    a->v[i] = b2 * a->v[i] + (1.0f - b2) * g[k] * g[k];
    p[k] -= (float)lr * (a->m[i] / c1) / (sqrtf(a->v[i] / c2) + eps);
  }
}

/* Trains and leaves replica 0's final parameters in `out`; returns the optimizer-state bytes of
   the replica that keeps the most. */
static size_t train(size_t replicas, size_t steps, size_t batch, double lr, int sharded, int describe,
                    float *out) {
  dpsync_options *opts = NULL;
  dpsync_context *ctx = NULL;
  CHECK(dpsync_options_new(&opts));
  CHECK(dpsync_options_set_host_replicas(opts, replicas));
  CHECK(dpsync_context_create(opts, &ctx));
  dpsync_options_free(opts);

  replica_t *reps = calloc(replicas, sizeof *reps);
  adam_t *state = calloc(replicas * N_TENSORS, sizeof *state);
  if (reps == NULL || state == NULL) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  for (size_t r = 0; r < replicas; r++) register_replica(ctx, &reps[r], r);
  init_params(reps[0].params);
  CHECK(dpsync_broadcast(ctx, DPSYNC_ROLE_PARAM, 0));
  if (describe) print_plan(ctx);

  /* The state: for the owned piece of each parameter (sharded), or for all of it. */
  size_t most = 0;
  for (size_t r = 0; r < replicas; r++) {
    size_t bytes = 0;
    for (int t = 0; t < N_TENSORS; t++) {
      adam_t *a = &state[r * N_TENSORS + t];
      if (sharded) {
        CHECK(dpsync_shard(ctx, TENSORS[t].name, r, &a->offset, &a->count));
      } else {
        a->offset = 0;
        a->count = TENSORS[t].count;
      }
      a->offset += TENSORS[t].offset; /* into the replica's parameter block */
      a->m = calloc(a->count + 1, sizeof(float));
      a->v = calloc(a->count + 1, sizeof(float));
      if (a->m == NULL || a->v == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(1);
      }
      bytes += 2 * a->count * sizeof(float);
    }
    if (bytes > most) most = bytes;
  }

  make_dataset();
  const size_t local_batch = batch / replicas;
  for (size_t step = 0; step < steps; step++) {
    for (size_t r = 0; r < replicas; r++)
      forward_backward(&reps[r], step * batch + r * local_batch, local_batch, 1.0 / (double)local_batch);
    /* The loss of each replica is a mean over its batch: AVG gives the mean gradient. */
    if (sharded) {
      CHECK(dpsync_reduce_scatter_grads(ctx, DPSYNC_REDUCE_AVG));
    } else {
      CHECK(dpsync_allreduce_grads(ctx, DPSYNC_REDUCE_AVG));
    }
    for (size_t r = 0; r < replicas; r++)
      for (int t = 0; t < N_TENSORS; t++)
        adam_step(reps[r].params, reps[r].grads, &state[r * N_TENSORS + t], lr, (int)step + 1);
    if (sharded) CHECK(dpsync_allgather(ctx, DPSYNC_ROLE_PARAM));
  }
  for (size_t r = 1; r < replicas; r++) {
    if (memcmp(reps[r].params, reps[0].params, sizeof reps[0].params) != 0) {
      fprintf(stderr, "replica %zu's parameters differ from replica 0's\n", r);
      exit(1);
    }
  }
  memcpy(out, reps[0].params, sizeof reps[0].params);
  for (size_t i = 0; i < replicas * N_TENSORS; i++) {
    free(state[i].m);
    free(state[i].v);
  }
  free(state);
  CHECK(dpsync_context_destroy(ctx));
  free(reps);
  return most;
}

int main(int argc, char **argv) {
  size_t replicas = 4, steps = 40, batch = 48;
  double lr = 0.01, tol = 0.0;
  int describe = 0;
  const char *save_path = NULL, *expect_path = NULL;
  for (int i = 1; i < argc; i++) {
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(argv[i], "--describe") == 0) {
      describe = 1;
      continue;
    }
    if (v == NULL) usage();
    if (strcmp(argv[i], "--replicas") == 0) {
      if (!parse_size(v, &replicas) || replicas == 0) usage();
    } else if (strcmp(argv[i], "--steps") == 0) {
      if (!parse_size(v, &steps) || steps == 0) usage();
    } else if (strcmp(argv[i], "--batch") == 0) {
      if (!parse_size(v, &batch) || batch == 0) usage();
    } else if (strcmp(argv[i], "--lr") == 0) {
      if (!parse_double(v, &lr) || lr <= 0.0) usage();
    } else if (strcmp(argv[i], "--tol") == 0) {
      if (!parse_double(v, &tol) || tol < 0.0) usage();
    } else if (strcmp(argv[i], "--save") == 0) {
      save_path = v;
    } else if (strcmp(argv[i], "--expect") == 0) {
      expect_path = v;
    } else {
      usage();
    }
    i++;
  }
  if (batch % replicas != 0) {
    fprintf(stderr, "--batch %zu is not a multiple of --replicas %zu\n", batch, replicas);
    return 1;
  }
  static float whole[N_PARAMS], zero[N_PARAMS];
  size_t whole_bytes = train(replicas, steps, batch, lr, 0, 0, whole);
  size_t zero_bytes = train(replicas, steps, batch, lr, 1, describe, zero);
  double diff = 0.0;
  for (int i = 0; i < N_PARAMS; i++) {
    double d = fabs((double)whole[i] - (double)zero[i]);
    if (d > diff || d != d) diff = d;
  }
  printf("zero_train: %zu replicas, %zu Adam steps: optimizer state per replica %zu bytes "
         "unsharded, %zu bytes sharded (1/%zu of it, one element per tensor more at most); "
         "largest difference of the final weights: %g\n",
         replicas, steps, whole_bytes, zero_bytes, replicas, diff);
  if (diff != 0.0 || memcmp(whole, zero, sizeof whole) != 0) {
    fprintf(stderr, "zero_train: the sharded run's weights differ from the unsharded run's\n");
    return 1;
  }
  if (zero_bytes * replicas > whole_bytes + 2 * sizeof(float) * N_TENSORS * replicas) {
    fprintf(stderr, "zero_train: the sharded state is not 1/%zu of the whole\n", replicas);
    return 1;
  }
  if (save_path != NULL) save_weights(save_path, zero);
  if (expect_path != NULL && !expect_weights(expect_path, zero, tol)) return 1;
  return 0;
}
