/*
 * train_dense — data-parallel SGD on N host replicas kept in sync by dpsync.
 *
 * A 2-layer MLP (8 -> 16 tanh -> 4 softmax, 212 parameters in 4 tensors) learns labels produced
 * by a fixed random "teacher" on synthetic, deterministic data. Each step every replica computes
 * the gradient of its shard of the global batch with the loss scaled by dpsync_loss_scale, the
 * gradients are SUMmed by dpsync_allreduce_grads, and every replica applies the same SGD update.
 *
 *   train_dense [--replicas N] [--steps S] [--batch B] [--lr LR] [--fusion-bytes X]
 *               [--save FILE] [--expect FILE --tol T] [--describe]
 */
#include <dpsync.h>

#include "dense_model.h"
#include "example_util.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(void) {
  fprintf(stderr,
          "usage: train_dense [--replicas N] [--steps S] [--batch B] [--lr LR] [--fusion-bytes X]\n"
          "                   [--save FILE] [--expect FILE --tol T] [--describe]\n"
          "  B is the global batch and must be a multiple of N.\n");
  exit(2);
}

/* ------------------------------------------------------------------ main */

int main(int argc, char **argv) {
  size_t replicas = 4, steps = 100, batch = 64, fusion_bytes = 0;
  int have_fusion = 0, describe = 0;
  double lr = 0.5, tol = 0.0;
  const char *save_path = NULL, *expect_path = NULL;

  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(a, "--describe") == 0) {
      describe = 1;
      continue;
    }
    if (v == NULL) usage();
    i++;
    if (strcmp(a, "--replicas") == 0) {
      if (!parse_size(v, &replicas) || replicas == 0) usage();
    } else if (strcmp(a, "--steps") == 0) {
      if (!parse_size(v, &steps) || steps == 0) usage();
    } else if (strcmp(a, "--batch") == 0) {
      if (!parse_size(v, &batch) || batch == 0) usage();
    } else if (strcmp(a, "--fusion-bytes") == 0) {
      if (!parse_size(v, &fusion_bytes)) usage();
      have_fusion = 1;
    } else if (strcmp(a, "--lr") == 0) {
      if (!parse_double(v, &lr) || lr <= 0.0) usage();
    } else if (strcmp(a, "--tol") == 0) {
      if (!parse_double(v, &tol) || tol < 0.0) usage();
    } else if (strcmp(a, "--save") == 0) {
      save_path = v;
    } else if (strcmp(a, "--expect") == 0) {
      expect_path = v;
    } else {
      usage();
    }
  }
  if (batch % replicas != 0) {
    fprintf(stderr, "--batch %zu is not a multiple of --replicas %zu\n", batch, replicas);
    return 1;
  }
  const size_t local_batch = batch / replicas;

  dpsync_options *opts = NULL;
  dpsync_context *ctx = NULL;
  CHECK(dpsync_options_new(&opts));
  CHECK(dpsync_options_set_host_replicas(opts, replicas));
  if (have_fusion) CHECK(dpsync_options_set_fusion_bytes(opts, fusion_bytes));
  CHECK(dpsync_context_create(opts, &ctx));
  dpsync_options_free(opts);

  size_t count = 0;
  double loss_scale = 0.0;
  CHECK(dpsync_replica_count(ctx, &count));
  CHECK(dpsync_loss_scale(ctx, &loss_scale));
  if (count != replicas) {
    fprintf(stderr, "dpsync_replica_count: %zu, expected %zu\n", count, replicas);
    return 1;
  }
  printf("train_dense: %zu host replicas, global batch %zu (%zu per replica), %zu steps, lr %g, "
         "loss scale %g, %d parameters\n",
         replicas, batch, local_batch, steps, lr, loss_scale, (int)N_PARAMS);

  replica_t *reps = calloc(replicas, sizeof *reps);
  if (reps == NULL) {
    fprintf(stderr, "out of memory\n");
    return 1;
  }
  for (size_t r = 0; r < replicas; r++) register_replica(ctx, &reps[r], r);

  /* Only replica 0 initialises; the broadcast must overwrite the others' (deliberately wrong)
     values, as after loading a checkpoint on one replica. */
  init_params(reps[0].params);
  for (size_t r = 1; r < replicas; r++)
    for (int i = 0; i < N_PARAMS; i++) reps[r].params[i] = (float)r * 100.0f + (float)i;
  CHECK(dpsync_broadcast(ctx, DPSYNC_ROLE_PARAM, 0));
  for (size_t r = 1; r < replicas; r++) {
    if (memcmp(reps[r].params, reps[0].params, sizeof reps[0].params) != 0) {
      fprintf(stderr, "after broadcast, replica %zu's params differ from replica 0's\n", r);
      return 1;
    }
  }

  if (describe) print_plan(ctx);

  make_dataset();
  double first_loss = 0.0, last_loss = 0.0;
  for (size_t step = 0; step < steps; step++) {
    /* Replicas are independent here; a real framework would run them in parallel. */
    for (size_t r = 0; r < replicas; r++) {
      forward_backward(&reps[r], step * batch + r * local_batch, local_batch, loss_scale / (double)local_batch);
      /* Overlap: declare each gradient final, in backward order. A bucket whose gradients are
         final on every replica starts reducing at once (from the second step, when dpsync knows
         the op); with replicas on their own threads or GPUs that overlaps the rest of backward.
         allreduce_grads then finishes what is left. */
      for (int t = N_TENSORS - 1; t >= 0; t--) CHECK(dpsync_grad_ready(ctx, TENSORS[t].grad_name, r));
    }
    CHECK(dpsync_allreduce_grads(ctx, DPSYNC_REDUCE_SUM));
    CHECK(dpsync_allreduce(ctx, "loss", DPSYNC_REDUCE_SUM));
    for (size_t r = 0; r < replicas; r++)
      for (int i = 0; i < N_PARAMS; i++) reps[r].params[i] -= (float)lr * reps[r].grads[i];

    if (step == 0) first_loss = reps[0].loss;
    last_loss = reps[0].loss;
    printf("step %zu loss %.6f\n", step, reps[0].loss);
  }

  int ok = 1;
  for (size_t r = 1; r < replicas; r++) {
    if (memcmp(reps[r].params, reps[0].params, sizeof reps[0].params) != 0 || reps[r].loss != reps[0].loss) {
      fprintf(stderr, "FAIL: replica %zu's weights differ from replica 0's\n", r);
      ok = 0;
    }
  }
  if (!(last_loss < first_loss)) {
    fprintf(stderr, "FAIL: loss did not fall (%.6f -> %.6f)\n", first_loss, last_loss);
    ok = 0;
  }
  if (save_path != NULL) save_weights(save_path, reps[0].params);
  if (expect_path != NULL && !expect_weights(expect_path, reps[0].params, tol)) {
    fprintf(stderr, "FAIL: weights differ from %s beyond tol %g\n", expect_path, tol);
    ok = 0;
  }

  CHECK(dpsync_context_destroy(ctx));
  free(reps);
  if (!ok) return 1;
  printf("final: loss %.6f -> %.6f after %zu steps; weights of all %zu replicas bytewise identical\n",
         first_loss, last_loss, steps, replicas);
  return 0;
}
