/*
 * uneven_inputs — ranks whose data runs out at different steps leave the world with dpsync_leave,
 * and the others train on without them (train_dense's model, one host replica per rank).
 *
 * Launched by mpirun / mpiexec / srun (one process per rank); dpsync initialises MPI itself.
 * Rank r (its number at creation) holds (r + 1) * K batches of B samples of its own. At step
 * s = (r + 1) * K its data has run out: it calls dpsync_leave instead of that step's
 * dpsync_allreduce_grads and stops, and the others' allreduce_grads of that step completes over
 * the remaining ranks, which are renumbered and recounted. The gradients are averaged
 * (DPSYNC_REDUCE_AVG), which counts the replicas that took part in each call: the ranks do not
 * know in advance who leaves at a step, so a loss scale taken before the call would still count
 * the leaver. The last rank trains alone for its last K steps, prints its final loss and weights
 * checksum, and leaves too (the world ends).
 *
 *   mpirun -n 3 uneven_inputs [--batches K] [--batch B] [--lr LR] [--describe]
 *                             [--save FILE] [--expect FILE --tol T]
 *
 * What it checks (exit code 1 on a failure):
 *   - after every step, each rank's dpsync_rank, rank count, dpsync_loss_scale and
 *     dpsync_world_epoch are what the schedule implies (the ranks that left so far renumber and
 *     recount the others; first_rank never moves);
 *   - a rank that left gets INVALID_STATE from a collective, and its epoch counts its own leave;
 *   - each rank's weights when it leaves are byte-identical to a reference trained in the same
 *     program by a context of host replicas only (one replica per rank still training, made
 *     again as ranks drop out). The sums are reproducible (dpsync_options_set_reproducible):
 *     a function of the multiset of contributions alone, so the world and the reference, which
 *     average the same gradients, agree to the bit — and a leaver's stale gradient counted, or
 *     a mean not recounted, would show;
 *   - the loss fell.
 * --describe prints the last rank's dpsync_describe JSON (its world's "epoch" and "left");
 * --save writes the last rank's final weights, --expect compares them against such a file.
 *
 * Exit code 77 (skipped) when the library was built without MPI.
 */
#include <dpsync.h>

#include "dense_model.h"
#include "example_util.h"

enum { SKIPPED = 77 };

static void usage(void) {
  fprintf(stderr,
          "usage: uneven_inputs [--batches K] [--batch B] [--lr LR] [--describe]\n"
          "                     [--save FILE] [--expect FILE --tol T]\n"
          "  rank r holds (r + 1) * K batches of B samples, then leaves the world.\n");
  exit(2);
}

/* Where rank r's batch of step s starts: every (step, rank) reads its own samples. */
static size_t first_sample(size_t step, size_t rank, size_t ranks, size_t batch) {
  return (step * ranks + rank) * batch;
}

/* Steps s < (r + 1) * K train on rank r; the ranks that left by the end of step s (their last
   collective was step s's) are those with (r + 1) * K <= s: the first min(s / K, ranks). */
static size_t left_by(size_t step, size_t k, size_t ranks) {
  size_t n = step / k;
  return n < ranks ? n : ranks;
}

/* One SGD step of `rep` on `count` replicas whose gradients are now summed. */
static void sgd(replica_t *rep, size_t count, double lr) {
  for (size_t r = 0; r < count; r++)
    for (int i = 0; i < N_PARAMS; i++) rep[r].params[i] -= (float)lr * rep[r].grads[i];
}

/* The weights after `steps` steps of the schedule, trained by host replicas in this process:
   in steps [p * K, (p + 1) * K), ranks p..ranks-1 train, each as one replica of a context made
   for that phase. */
static void reference(size_t ranks, size_t k, size_t batch, double lr, size_t steps, float *out) {
  replica_t *reps = calloc(ranks, sizeof *reps);
  if (reps == NULL) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  for (size_t r = 0; r < ranks; r++) init_params(reps[r].params);
  for (size_t p = 0; p < ranks && p * k < steps; p++) {
    const size_t active = ranks - p;
    dpsync_options *opts = NULL;
    dpsync_context *ctx = NULL;
    CHECK(dpsync_options_new(&opts));
    CHECK(dpsync_options_set_host_replicas(opts, active));
    CHECK(dpsync_options_set_reproducible(opts, true));
    CHECK(dpsync_context_create(opts, &ctx));
    dpsync_options_free(opts);
    for (size_t j = 0; j < active; j++) register_replica(ctx, &reps[p + j], j);
    for (size_t s = p * k; s < (p + 1) * k && s < steps; s++) {
      for (size_t j = 0; j < active; j++)
        forward_backward(&reps[p + j], first_sample(s, p + j, ranks, batch), batch,
                         1.0 / (double)batch);
      CHECK(dpsync_allreduce_grads(ctx, DPSYNC_REDUCE_AVG));
      CHECK(dpsync_allreduce(ctx, "loss", DPSYNC_REDUCE_AVG));
      sgd(&reps[p], active, lr);
    }
    CHECK(dpsync_context_destroy(ctx));
  }
  memcpy(out, reps[ranks - 1].params, sizeof reps[0].params);
  free(reps);
}

/* FNV-1a over the weights' bytes: a short fingerprint to compare runs by eye. */
static uint64_t checksum(const float *params) {
  const unsigned char *b = (const unsigned char *)params;
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < N_PARAMS * sizeof(float); i++) h = (h ^ b[i]) * 0x100000001b3ULL;
  return h;
}

int main(int argc, char **argv) {
  size_t k = 8, batch = 16;
  double lr = 0.5, tol = 0.0;
  int describe = 0;
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
    if (strcmp(a, "--batches") == 0) {
      if (!parse_size(v, &k) || k == 0) usage();
    } else if (strcmp(a, "--batch") == 0) {
      if (!parse_size(v, &batch) || batch == 0) usage();
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

  dpsync_options *opts = NULL;
  dpsync_context *ctx = NULL;
  CHECK(dpsync_options_new(&opts));
  CHECK(dpsync_options_set_host_replicas(opts, 1));
  CHECK(dpsync_options_set_reproducible(opts, true));
  dpsync_status st = dpsync_options_set_world_mpi(opts, NULL);
  if (st == DPSYNC_STATUS_UNAVAILABLE) {
    printf("uneven_inputs: skipped: %s\n", dpsync_last_error());
    dpsync_options_free(opts);
    return SKIPPED;
  }
  CHECK(st);
  CHECK(dpsync_context_create(opts, &ctx));
  dpsync_options_free(opts);

  size_t me = 0, ranks = 0; /* this rank's number at creation, the ranks at creation */
  CHECK(dpsync_rank(ctx, &me, &ranks));
  const size_t my_steps = (me + 1) * k;
  printf("uneven_inputs: rank %zu of %zu holds %zu batches of %zu samples\n", me, ranks, my_steps,
         batch);

  replica_t rep;
  memset(&rep, 0, sizeof rep);
  register_replica(ctx, &rep, 0);
  if (me == 0) init_params(rep.params);
  CHECK(dpsync_broadcast(ctx, DPSYNC_ROLE_PARAM, 0));
  make_dataset();

  int ok = 1;
  double first_loss = 0.0;
  for (size_t step = 0; step < my_steps; step++) {
    forward_backward(&rep, first_sample(step, me, ranks, batch), batch, 1.0 / (double)batch);
    CHECK(dpsync_allreduce_grads(ctx, DPSYNC_REDUCE_AVG));
    CHECK(dpsync_allreduce(ctx, "loss", DPSYNC_REDUCE_AVG));
    sgd(&rep, 1, lr);
    if (step == 0) first_loss = rep.loss;

    size_t rank = 0, now = 0, first_rank = 0;
    uint64_t epoch = 0;
    double loss_scale = 0.0;
    CHECK(dpsync_rank(ctx, &rank, &now));
    CHECK(dpsync_world_epoch(ctx, &epoch, &first_rank));
    CHECK(dpsync_loss_scale(ctx, &loss_scale));
    const size_t gone = left_by(step, k, ranks);
    if (rank != me - gone || now != ranks - gone || epoch != gone || first_rank != me ||
        loss_scale != 1.0 / (double)(ranks - gone)) {
      fprintf(stderr,
              "FAIL: rank %zu after step %zu: rank %zu of %zu, epoch %llu, first_rank %zu, loss "
              "scale %g; expected rank %zu of %zu, epoch %zu, first_rank %zu, loss scale 1/%zu\n",
              me, step, rank, now, (unsigned long long)epoch, first_rank, loss_scale, me - gone,
              ranks - gone, gone, me, ranks - gone);
      ok = 0;
    }
    if (rank == 0 && (step + 1) % k == 0)
      printf("step %zu: loss %.6f over %zu ranks (epoch %llu)\n", step, rep.loss, now,
             (unsigned long long)epoch);
  }

  /* The data ran out: leave at once (the others wait for it in their next collective), then
     check. */
  const int last = me + 1 == ranks;
  float mine[N_PARAMS];
  memcpy(mine, rep.params, sizeof mine);
  if (last && describe) print_plan(ctx);
  CHECK(dpsync_leave(ctx));
  uint64_t epoch = 0;
  size_t first_rank = 0;
  CHECK(dpsync_world_epoch(ctx, &epoch, &first_rank));
  if (epoch != me + 1 || first_rank != me) {
    fprintf(stderr,
            "FAIL: rank %zu: after leaving, epoch %llu and first_rank %zu (expected %zu, %zu)\n", me,
            (unsigned long long)epoch, first_rank, me + 1, me);
    ok = 0;
  }
  st = dpsync_allreduce_grads(ctx, DPSYNC_REDUCE_AVG);
  if (st != DPSYNC_STATUS_INVALID_STATE) {
    fprintf(stderr, "FAIL: rank %zu: a collective after leaving returned %s\n", me,
            dpsync_status_name(st));
    ok = 0;
  }
  CHECK(dpsync_context_destroy(ctx));

  float ref[N_PARAMS];
  reference(ranks, k, batch, lr, my_steps, ref);
  if (memcmp(mine, ref, sizeof ref) != 0) {
    fprintf(stderr, "FAIL: rank %zu: weights after %zu steps differ from the reference's\n", me,
            my_steps);
    ok = 0;
  }
  if (!(rep.loss < first_loss)) {
    fprintf(stderr, "FAIL: rank %zu: loss did not fall (%.6f -> %.6f)\n", me, first_loss, rep.loss);
    ok = 0;
  }
  if (last) {
    printf("final (rank %zu, alone for its last %zu steps): loss %.6f -> %.6f, weights checksum "
           "%016llx\n",
           me, k, first_loss, rep.loss, (unsigned long long)checksum(mine));
    if (save_path != NULL) save_weights(save_path, mine);
    if (expect_path != NULL && !expect_weights(expect_path, mine, tol)) {
      fprintf(stderr, "FAIL: rank %zu: weights differ from %s beyond tol %g\n", me, expect_path,
              tol);
      ok = 0;
    }
  }
  if (!ok) return 1;
  printf("rank %zu: left after %zu steps, weights equal to the reference's\n", me, my_steps);
  return 0;
}
