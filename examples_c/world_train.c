/*
 * world_train — train_dense's model trained by a world of processes, each with its own number of
 * host replicas, kept in sync by one dpsync context per process over MPI.
 *
 * Launched by mpirun / mpiexec / srun (one process per rank). dpsync initialises MPI itself (the
 * options name no communicator: MPI_COMM_WORLD), so this program needs no MPI header. World
 * replica w (rank offset + local index) computes the w-th shard of the global batch, exactly as
 * replica w of `train_dense --replicas <total>` does, so both end with the same weights up to
 * the rounding of the summation order.
 *
 *   mpirun -n 2 world_train --replicas-per-rank 3,1 [--steps S] [--batch B] [--lr LR]
 *                           [--save FILE] [--expect FILE --tol T] [--describe]
 *                           [--reproducible] [--elastic MIN] [--kill R:S | --leave R:S]
 *
 * --save FILE writes rank 0's final weights (N_PARAMS raw floats); --expect FILE --tol T compares
 * every rank's against such a file. --describe prints rank 0's dpsync_describe JSON.
 * --reproducible sets dpsync_options_set_reproducible on every rank: every float SUM (the F32
 * gradients, the F64 loss) then gives the same bytes however the world's replicas are spread over
 * the ranks, so `--replicas-per-rank 4`, `2,2`, `1,1,1,1` and `2,1,1` save byte-identical weights.
 * Without it the summation order follows the arrangement and some of them end a few bits apart
 * (the CTests world_train_reproducible and world_train_plain_differs check both: CMakeLists.txt,
 * world_repro.cmake).
 *
 * Ranks that go away (the gradients are then averaged, DPSYNC_REDUCE_AVG, which counts the
 * replicas that took part in each call; every replica keeps reading the samples it read at the
 * start, so the lost or leaving rank's data is dropped from that step on):
 * --elastic MIN makes the world elastic (dpsync_options_set_elastic; an MPI with ULFM, started
 * with `mpirun --with-ft ulfm`): it goes on while MIN ranks remain. --kill R:S makes rank R kill
 * itself (SIGKILL) in step S, after its gradients were marked ready; every other rank gets
 * DPSYNC_STATUS_RANK_LOST from the collective that loss interrupts, computes the step's
 * gradients again and redoes the step over the survivors. --leave R:S makes rank R call
 * dpsync_leave instead of step S and stop (uneven inputs; any world). With --reproducible the
 * survivors of a --kill run end byte-identical to a --leave run with the same R:S (the CTest
 * world_train_elastic, world_elastic.cmake).
 *
 * Exit code 77 (skipped) when the library was built without MPI.
 */
#include <dpsync.h>

#include "dense_model.h"
#include "example_util.h"

#include <signal.h>

enum { MAX_RANKS = 64, SKIPPED = 77 };

static void usage(void) {
  fprintf(stderr,
          "usage: world_train --replicas-per-rank N0,N1,... [--steps S] [--batch B] [--lr LR]\n"
          "                   [--save FILE] [--expect FILE --tol T] [--describe]\n"
          "                   [--reproducible] [--elastic MIN] [--kill R:S | --leave R:S]\n"
          "  one count per rank; B must be a multiple of the total.\n"
          "  --reproducible: float sums give the same bytes whatever the arrangement of the\n"
          "  replicas over the ranks (dpsync_options_set_reproducible).\n"
          "  --elastic MIN: the world goes on while MIN ranks remain (an MPI with ULFM).\n"
          "  --kill R:S / --leave R:S: rank R is killed in / leaves at step S.\n");
  exit(2);
}

/* "3,1,2" -> counts; returns how many, 0 on a malformed list. */
static size_t parse_counts(const char *text, size_t *counts) {
  size_t n = 0;
  char buf[512];
  if (strlen(text) >= sizeof buf) return 0;
  strcpy(buf, text);
  for (char *tok = strtok(buf, ","); tok != NULL; tok = strtok(NULL, ",")) {
    if (n == MAX_RANKS || !parse_size(tok, &counts[n]) || counts[n] == 0) return 0;
    n++;
  }
  return n;
}

/* "R:S" -> rank and step; 0 on a malformed pair. */
static int parse_rank_step(const char *text, size_t *rank, size_t *step) {
  char buf[64];
  char *colon;
  if (strlen(text) >= sizeof buf) return 0;
  strcpy(buf, text);
  if ((colon = strchr(buf, ':')) == NULL) return 0;
  *colon = '\0';
  return parse_size(buf, rank) && parse_size(colon + 1, step);
}

/* A context over the world with `replicas` host replicas on this rank, reproducible sums on or
   off (every rank must agree), elastic when `min_ranks` > 0; 0 when the library has no MPI, or
   no ULFM for an elastic world (the caller skips). */
static dpsync_context *world_context(size_t replicas, bool reproducible, size_t min_ranks) {
  dpsync_options *opts = NULL;
  dpsync_context *ctx = NULL;
  CHECK(dpsync_options_new(&opts));
  CHECK(dpsync_options_set_host_replicas(opts, replicas));
  CHECK(dpsync_options_set_reproducible(opts, reproducible));
  dpsync_status st = dpsync_options_set_world_mpi(opts, NULL);
  if (st == DPSYNC_STATUS_UNAVAILABLE) {
    printf("world_train: skipped: %s\n", dpsync_last_error());
    dpsync_options_free(opts);
    return NULL;
  }
  CHECK(st);
  if (min_ranks > 0) CHECK(dpsync_options_set_elastic(opts, min_ranks));
  st = dpsync_context_create(opts, &ctx);
  dpsync_options_free(opts);
  if (st == DPSYNC_STATUS_UNAVAILABLE && min_ranks > 0) {
    printf("world_train: skipped: %s\n", dpsync_last_error());
    return NULL;
  }
  CHECK(st);
  return ctx;
}

int main(int argc, char **argv) {
  size_t counts[MAX_RANKS], n_counts = 0, steps = 100, batch = 64;
  int describe = 0;
  bool reproducible = false;
  double lr = 0.5, tol = 0.0;
  const char *save_path = NULL, *expect_path = NULL;
  size_t min_ranks = 0, kill_rank = 0, kill_step = 0, leave_rank = 0, leave_step = 0;
  bool kill = false, leave = false;

  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(a, "--describe") == 0) {
      describe = 1;
      continue;
    }
    if (strcmp(a, "--reproducible") == 0) {
      reproducible = true;
      continue;
    }
    if (v == NULL) usage();
    i++;
    if (strcmp(a, "--replicas-per-rank") == 0) {
      if ((n_counts = parse_counts(v, counts)) == 0) usage();
    } else if (strcmp(a, "--steps") == 0) {
      if (!parse_size(v, &steps) || steps == 0) usage();
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
    } else if (strcmp(a, "--elastic") == 0) {
      if (!parse_size(v, &min_ranks) || min_ranks == 0) usage();
    } else if (strcmp(a, "--kill") == 0) {
      if (!(kill = parse_rank_step(v, &kill_rank, &kill_step))) usage();
    } else if (strcmp(a, "--leave") == 0) {
      if (!(leave = parse_rank_step(v, &leave_rank, &leave_step))) usage();
    } else {
      usage();
    }
  }
  if (n_counts == 0 || (kill && leave) || (kill && min_ranks == 0)) usage();
  /* Ranks that go away: the gradients are averaged over whoever took part (the loss scale of a
     SUM would still count them). */
  const bool shrinks = kill || leave;

  /* The rank decides the local replica count, and a context tells the rank: a first context
     with one replica per rank (creation is collective) asks, then the real one is made. */
  dpsync_context *probe = world_context(1, reproducible, 0);
  if (probe == NULL) return SKIPPED;
  size_t rank = 0, ranks = 0;
  CHECK(dpsync_rank(probe, &rank, &ranks));
  CHECK(dpsync_context_destroy(probe));
  if (ranks != n_counts) {
    fprintf(stderr, "rank %zu: --replicas-per-rank lists %zu counts for %zu ranks\n", rank,
            n_counts, ranks);
    return 1;
  }
  const size_t replicas = counts[rank];
  dpsync_context *ctx = world_context(replicas, reproducible, min_ranks);
  if (ctx == NULL) return min_ranks > 0 ? SKIPPED : 1; /* MPI was there a moment ago */

  size_t total = 0, offset = 0;
  double loss_scale = 0.0;
  CHECK(dpsync_world_replicas(ctx, &total, &offset));
  CHECK(dpsync_loss_scale(ctx, &loss_scale));
  if (batch % total != 0) {
    fprintf(stderr, "--batch %zu is not a multiple of the %zu replicas of the world\n", batch, total);
    return 1;
  }
  const size_t local_batch = batch / total;
  printf("world_train: rank %zu of %zu, %zu host replicas (world replicas %zu..%zu of %zu), "
         "global batch %zu, %zu steps, lr %g, loss scale %g%s\n",
         rank, ranks, replicas, offset, offset + replicas - 1, total, batch, steps, lr, loss_scale,
         reproducible ? ", reproducible sums" : "");

  replica_t *reps = calloc(replicas, sizeof *reps);
  if (reps == NULL) {
    fprintf(stderr, "out of memory\n");
    return 1;
  }
  for (size_t r = 0; r < replicas; r++) register_replica(ctx, &reps[r], r);

  /* Only world replica 0 initialises; the broadcast from it (a world index) overwrites every
     other replica of every rank. */
  for (size_t r = 0; r < replicas; r++)
    for (int i = 0; i < N_PARAMS; i++) reps[r].params[i] = (float)(offset + r) * 100.0f + (float)i;
  if (offset == 0) init_params(reps[0].params);
  CHECK(dpsync_broadcast(ctx, DPSYNC_ROLE_PARAM, 0));

  if (describe && rank == 0) print_plan(ctx);

  make_dataset();
  double first_loss = 0.0, last_loss = 0.0;
  const double coef = (shrinks ? 1.0 : loss_scale) / (double)local_batch;
  const dpsync_reduce_op op = shrinks ? DPSYNC_REDUCE_AVG : DPSYNC_REDUCE_SUM;
  for (size_t step = 0; step < steps; step++) {
    if (leave && rank == leave_rank && step == leave_step) {
      CHECK(dpsync_leave(ctx));
      printf("world_train: rank %zu left at step %zu\n", rank, step);
      break;
    }
    dpsync_status st;
    do { /* again after a lost rank: the step's gradients are computed anew */
      for (size_t r = 0; r < replicas; r++) {
        forward_backward(&reps[r], step * batch + (offset + r) * local_batch, local_batch, coef);
        for (int t = N_TENSORS - 1; t >= 0; t--)
          CHECK(dpsync_grad_ready(ctx, TENSORS[t].grad_name, r));
      }
      if (kill && rank == kill_rank && step == kill_step) raise(SIGKILL);
      st = dpsync_allreduce_grads(ctx, op);
      if (st == DPSYNC_STATUS_RANK_LOST)
        printf("world_train: rank %zu, step %zu: %s; the step again\n", rank, step,
               dpsync_last_error());
    } while (st == DPSYNC_STATUS_RANK_LOST);
    CHECK(st);
    /* A loss here leaves the loss's bytes as they were: the same call again. */
    while ((st = dpsync_allreduce(ctx, "loss", op)) == DPSYNC_STATUS_RANK_LOST) {
    }
    CHECK(st);
    for (size_t r = 0; r < replicas; r++)
      for (int i = 0; i < N_PARAMS; i++) reps[r].params[i] -= (float)lr * reps[r].grads[i];
    if (step == 0) first_loss = reps[0].loss;
    last_loss = reps[0].loss;
    if (rank == 0) printf("step %zu loss %.6f\n", step, reps[0].loss);
  }

  int ok = 1;
  for (size_t r = 1; r < replicas; r++) {
    if (memcmp(reps[r].params, reps[0].params, sizeof reps[0].params) != 0) {
      fprintf(stderr, "FAIL: rank %zu: replica %zu's weights differ from replica 0's\n", rank, r);
      ok = 0;
    }
  }
  if (!(last_loss < first_loss)) {
    fprintf(stderr, "FAIL: rank %zu: loss did not fall (%.6f -> %.6f)\n", rank, first_loss, last_loss);
    ok = 0;
  }
  if (save_path != NULL && rank == 0) save_weights(save_path, reps[0].params);
  if (expect_path != NULL && !expect_weights(expect_path, reps[0].params, tol)) {
    fprintf(stderr, "FAIL: rank %zu: weights differ from %s beyond tol %g\n", rank, expect_path, tol);
    ok = 0;
  }
  CHECK(dpsync_context_destroy(ctx));
  free(reps);
  if (!ok) return 1;
  printf("final (rank %zu): loss %.6f -> %.6f after %zu steps\n", rank, first_loss, last_loss, steps);
  return 0;
}
