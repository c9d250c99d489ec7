/*
 * bmuf_train — local SGD on N host replicas merged every K steps by BMUF (dpsync_bmuf_step),
 * printed beside fully synchronous SGD (dpsync_allreduce_grads every step) on the same data.
 *
 * A synthetic linear regression, y = x . w_true + b_true + noise with 32 features. Replica r
 * trains on its own shard (samples r, r + N, r + 2N, ...); at step s both runs give replica r
 * the same minibatch, so the only difference is how the replicas are kept in sync:
 *   - BMUF: each replica takes K plain SGD steps alone, then dpsync_bmuf_step merges them
 *     (one collective per K steps);
 *   - synchronous SGD: the gradients are averaged by dpsync_allreduce_grads at every step.
 * The program exits non-zero unless the BMUF loss falls to a tenth of its start and every
 * replica holds the same bytes after every BMUF step.
 *
 * With --gpus the BMUF run's params live on CUDA replicas (one per listed GPU ordinal, e.g.
 * 0,0,0,0): each block uploads the replicas' params on their own streams, dpsync_bmuf_step runs
 * in stream order, and the result is read back on the same streams (the local steps stay on the
 * host, as this example's "framework"). It exits 77 (CTest: skipped) without a usable GPU.
 *
 *   bmuf_train [--replicas N | --gpus 0,0,...] [--transport auto|nccl|peer_copy] [--blocks B]
 *              [--local-steps K] [--batch M] [--lr LR] [--block-lr ETA] [--block-momentum MU]
 *              [--nesterov]
 *   MU < 0 (the default) selects 1 - 1/N.
 */
#include <dpsync.h>

#include "cuda_driver.h"
#include "example_util.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { DIM = 32, DATASET = 4096, MAX_GPUS = 64 };

typedef struct {
  float w[DIM];
  float b[1];
  float gw[DIM]; /* gradients: registered only in the synchronous run */
  float gb[1];
} replica_t;


/* The same numbers on every platform, unlike rand(). */
typedef struct {
  uint64_t state;
} lcg_t;

static double lcg_uniform(lcg_t *g, double lo, double hi) {
  g->state = g->state * 6364136223846793005ULL + 1442695040888963407ULL;
  return lo + (hi - lo) * (double)(g->state >> 11) / 9007199254740992.0; /* 53 bits, [0,1) */
}

static void usage(void) {
  fprintf(stderr,
          "usage: bmuf_train [--replicas N | --gpus 0,0,...] [--transport auto|nccl|peer_copy]\n"
          "                  [--blocks B] [--local-steps K] [--batch M] [--lr LR]\n"
          "                  [--block-lr ETA] [--block-momentum MU] [--nesterov]\n");
  exit(2);
}

/* ------------------------------------------------------------------ data and model */

static float data_x[DATASET][DIM];
static float data_y[DATASET];

static void make_dataset(void) {
  lcg_t g = {0xb40f0001ULL};
  float w_true[DIM];
  for (int i = 0; i < DIM; i++) w_true[i] = (float)lcg_uniform(&g, -1.0, 1.0);
  const float b_true = 0.5f;
  for (int n = 0; n < DATASET; n++) {
    float y = b_true;
    for (int i = 0; i < DIM; i++) {
      data_x[n][i] = (float)lcg_uniform(&g, -1.0, 1.0);
      y += w_true[i] * data_x[n][i];
    }
    data_y[n] = y + (float)lcg_uniform(&g, -0.1, 0.1);
  }
}

/* Sample j of replica r's shard at global position `pos` (cyclic). */
static size_t sample(size_t replicas, size_t r, size_t pos) {
  size_t per_shard = DATASET / replicas;
  return (pos % per_shard) * replicas + r;
}

/* Gradient of the mean of 0.5 * (x.w + b - y)^2 over replica r's minibatch of step `step`. */
static void gradient(const replica_t *p, size_t replicas, size_t r, size_t step, size_t batch,
                     float *gw, float *gb) {
  memset(gw, 0, DIM * sizeof *gw);
  *gb = 0.0f;
  for (size_t j = 0; j < batch; j++) {
    size_t n = sample(replicas, r, step * batch + j);
    float err = p->b[0] - data_y[n];
    for (int i = 0; i < DIM; i++) err += p->w[i] * data_x[n][i];
    for (int i = 0; i < DIM; i++) gw[i] += err * data_x[n][i] / (float)batch;
    *gb += err / (float)batch;
  }
}

/* Mean squared error of one replica's model over the whole dataset. */
static double loss(const replica_t *p) {
  double sum = 0.0;
  for (int n = 0; n < DATASET; n++) {
    double err = (double)p->b[0] - data_y[n];
    for (int i = 0; i < DIM; i++) err += (double)p->w[i] * data_x[n][i];
    sum += err * err;
  }
  return sum / DATASET;
}

/* Replica 0 gets the initial model; the others hold deliberately wrong values that the
   broadcast (dpsync_bmuf_init, dpsync_broadcast) must overwrite. */
static void initialise(replica_t *reps, size_t replicas) {
  lcg_t g = {0x1217ULL};
  for (int i = 0; i < DIM; i++) reps[0].w[i] = (float)lcg_uniform(&g, -0.1, 0.1);
  reps[0].b[0] = 0.0f;
  for (size_t r = 1; r < replicas; r++) {
    for (int i = 0; i < DIM; i++) reps[r].w[i] = 100.0f * (float)r;
    reps[r].b[0] = -100.0f;
  }
}

/* Host replicas, or CUDA replicas on `gpus` (when ngpus > 0) over `transport`. */
static dpsync_context *make_context(size_t replicas, const int32_t *gpus, size_t ngpus,
                                    uint32_t transport) {
  dpsync_options *opts = NULL;
  dpsync_context *ctx = NULL;
  CHECK(dpsync_options_new(&opts));
  if (ngpus > 0) {
    CHECK(dpsync_options_set_cuda_replicas(opts, gpus, ngpus));
    CHECK(dpsync_options_set_transport(opts, transport));
  } else {
    CHECK(dpsync_options_set_host_replicas(opts, replicas));
  }
  CHECK(dpsync_context_create(opts, &ctx));
  dpsync_options_free(opts);
  return ctx;
}

/* ------------------------------------------------------------------ params on CUDA replicas */

typedef struct {
  CUdeviceptr w, b;
  CUstream stream;
} device_params_t;

/* Device memory and a stream per replica on its GPU, registered as the BMUF context's PARAMs. */
static device_params_t *device_params(dpsync_context *ctx, const int32_t *gpus, size_t n) {
  device_params_t *dev = calloc(n, sizeof *dev);
  if (dev == NULL) exit(1);
  for (size_t r = 0; r < n; r++) {
    use_gpu(gpus[r]);
    CU(cu.mem_alloc(&dev[r].w, DIM * sizeof(float)));
    CU(cu.mem_alloc(&dev[r].b, sizeof(float)));
    CU(cu.stream_create(&dev[r].stream, 1 /* non-blocking */));
    CHECK(dpsync_set_stream(ctx, r, dev[r].stream));
    CHECK(dpsync_register(ctx, "w", DPSYNC_ROLE_PARAM, r, (void *)(uintptr_t)dev[r].w, DIM,
                          DPSYNC_DTYPE_F32));
    CHECK(dpsync_register(ctx, "b", DPSYNC_ROLE_PARAM, r, (void *)(uintptr_t)dev[r].b, 1,
                          DPSYNC_DTYPE_F32));
  }
  return dev;
}

/* The host params into the device params, queued on each replica's stream. */
static void upload(const replica_t *reps, const device_params_t *dev, size_t n) {
  for (size_t r = 0; r < n; r++) {
    CU(cu.htod_async(dev[r].w, reps[r].w, sizeof reps[r].w, dev[r].stream));
    CU(cu.htod_async(dev[r].b, reps[r].b, sizeof reps[r].b, dev[r].stream));
  }
}

/* The device params back, queued on each replica's stream after whatever dpsync queued there
   (its completion events order the copies), then waited for. */
static void download(replica_t *reps, const device_params_t *dev, size_t n) {
  for (size_t r = 0; r < n; r++) {
    CU(cu.dtoh_async(reps[r].w, dev[r].w, sizeof reps[r].w, dev[r].stream));
    CU(cu.dtoh_async(reps[r].b, dev[r].b, sizeof reps[r].b, dev[r].stream));
    CU(cu.stream_sync(dev[r].stream));
  }
}

static int same_params(const replica_t *reps, size_t replicas) {
  for (size_t r = 1; r < replicas; r++)
    if (memcmp(reps[r].w, reps[0].w, sizeof reps[0].w) != 0 ||
        memcmp(reps[r].b, reps[0].b, sizeof reps[0].b) != 0)
      return 0;
  return 1;
}

/* ------------------------------------------------------------------ main */

int main(int argc, char **argv) {
  size_t replicas = 4, blocks = 25, local_steps = 8, batch = 16, ngpus = 0;
  double lr = 0.05, block_lr = 1.0, block_momentum = -1.0;
  bool nesterov = false;
  int32_t gpus[MAX_GPUS];
  uint32_t transport = DPSYNC_TRANSPORT_AUTO;

  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(a, "--nesterov") == 0) {
      nesterov = true;
      continue;
    }
    if (v == NULL) usage();
    i++;
    if (strcmp(a, "--replicas") == 0) {
      if (!parse_size(v, &replicas) || replicas == 0 || replicas > DATASET) usage();
    } else if (strcmp(a, "--gpus") == 0) {
      ngpus = parse_gpus(argv[i], gpus, MAX_GPUS);
      if (ngpus == 0) usage();
      replicas = ngpus;
    } else if (strcmp(a, "--transport") == 0) {
      int ok;
      transport = parse_transport(v, &ok);
      if (!ok) usage();
    } else if (strcmp(a, "--blocks") == 0) {
      if (!parse_size(v, &blocks) || blocks == 0) usage();
    } else if (strcmp(a, "--local-steps") == 0) {
      if (!parse_size(v, &local_steps) || local_steps == 0) usage();
    } else if (strcmp(a, "--batch") == 0) {
      if (!parse_size(v, &batch) || batch == 0) usage();
    } else if (strcmp(a, "--lr") == 0) {
      if (!parse_double(v, &lr) || lr <= 0.0) usage();
    } else if (strcmp(a, "--block-lr") == 0) {
      /* Range checks are the library's: a bad value is reported by dpsync_bmuf_init. */
      if (!parse_double(v, &block_lr)) usage();
    } else if (strcmp(a, "--block-momentum") == 0) {
      if (!parse_double(v, &block_momentum)) usage();
    } else {
      usage();
    }
  }
  if (ngpus > 0 && !cuda_usable("bmuf_train", gpus, ngpus)) return CUDA_SKIP;
  make_dataset();

  replica_t *bm = calloc(replicas, sizeof *bm);   /* the BMUF run */
  replica_t *sync = calloc(replicas, sizeof *sync); /* the synchronous-SGD run */
  if (bm == NULL || sync == NULL) {
    fprintf(stderr, "out of memory\n");
    return 1;
  }
  initialise(bm, replicas);
  initialise(sync, replicas);

  /* BMUF filters the PARAM tensors; it needs no gradients registered. On CUDA replicas the
     params it filters are device copies of bm[r], uploaded before and read back after. */
  dpsync_context *bctx = make_context(replicas, gpus, ngpus, transport);
  device_params_t *dev = NULL;
  if (ngpus > 0) {
    dev = device_params(bctx, gpus, ngpus);
    upload(bm, dev, replicas);
  } else {
    for (size_t r = 0; r < replicas; r++) {
      CHECK(dpsync_register(bctx, "w", DPSYNC_ROLE_PARAM, r, bm[r].w, DIM, DPSYNC_DTYPE_F32));
      CHECK(dpsync_register(bctx, "b", DPSYNC_ROLE_PARAM, r, bm[r].b, 1, DPSYNC_DTYPE_F32));
    }
  }
  CHECK(dpsync_bmuf_init(bctx, block_lr, block_momentum, nesterov));
  if (dev) download(bm, dev, replicas);
  if (!same_params(bm, replicas)) {
    fprintf(stderr, "FAIL: dpsync_bmuf_init did not broadcast replica 0's params\n");
    return 1;
  }

  dpsync_context *sctx = make_context(replicas, NULL, 0, transport);
  for (size_t r = 0; r < replicas; r++) {
    CHECK(dpsync_register(sctx, "w", DPSYNC_ROLE_PARAM, r, sync[r].w, DIM, DPSYNC_DTYPE_F32));
    CHECK(dpsync_register(sctx, "b", DPSYNC_ROLE_PARAM, r, sync[r].b, 1, DPSYNC_DTYPE_F32));
    CHECK(dpsync_register(sctx, "w_grad", DPSYNC_ROLE_GRAD, r, sync[r].gw, DIM, DPSYNC_DTYPE_F32));
    CHECK(dpsync_register(sctx, "b_grad", DPSYNC_ROLE_GRAD, r, sync[r].gb, 1, DPSYNC_DTYPE_F32));
  }
  CHECK(dpsync_broadcast(sctx, DPSYNC_ROLE_PARAM, 0));

  printf("bmuf_train: %zu %s replicas, %zu blocks of %zu local SGD steps (batch %zu per replica, "
         "lr %g), BMUF block_lr %g, block_momentum %g%s, %s\n",
         replicas, ngpus > 0 ? "CUDA" : "host", blocks, local_steps, batch, lr, block_lr, block_momentum,
         block_momentum < 0.0 ? " (default 1 - 1/N)" : "", nesterov ? "Nesterov" : "classical");
  const double first = loss(&bm[0]);
  printf("%5s %6s %14s %16s\n", "block", "step", "BMUF loss", "sync SGD loss");
  printf("%5d %6d %14.6f %16.6f\n", 0, 0, first, loss(&sync[0]));

  float gw[DIM], gb;
  size_t step = 0;
  for (size_t block = 1; block <= blocks; block++) {
    for (size_t k = 0; k < local_steps; k++, step++) {
      /* BMUF: every replica on its own; a real framework runs them in parallel. */
      for (size_t r = 0; r < replicas; r++) {
        gradient(&bm[r], replicas, r, step, batch, gw, &gb);
        for (int i = 0; i < DIM; i++) bm[r].w[i] -= (float)lr * gw[i];
        bm[r].b[0] -= (float)lr * gb;
      }
      /* Synchronous SGD: the same minibatches, gradients averaged every step. */
      for (size_t r = 0; r < replicas; r++)
        gradient(&sync[r], replicas, r, step, batch, sync[r].gw, sync[r].gb);
      CHECK(dpsync_allreduce_grads(sctx, DPSYNC_REDUCE_AVG));
      for (size_t r = 0; r < replicas; r++) {
        for (int i = 0; i < DIM; i++) sync[r].w[i] -= (float)lr * sync[r].gw[i];
        sync[r].b[0] -= (float)lr * sync[r].gb[0];
      }
    }
    if (dev) upload(bm, dev, replicas);
    CHECK(dpsync_bmuf_step(bctx));
    if (dev) download(bm, dev, replicas);
    if (!same_params(bm, replicas)) {
      fprintf(stderr, "FAIL: after BMUF step %zu the replicas' params differ\n", block);
      return 1;
    }
    printf("%5zu %6zu %14.6f %16.6f\n", block, step, loss(&bm[0]), loss(&sync[0]));
  }

  const double last = loss(&bm[0]);
  const double sync_last = loss(&sync[0]);
  CHECK(dpsync_context_destroy(bctx));
  CHECK(dpsync_context_destroy(sctx));
  for (size_t r = 0; dev && r < ngpus; r++) {
    CU(cu.mem_free(dev[r].w));
    CU(cu.mem_free(dev[r].b));
    CU(cu.stream_destroy(dev[r].stream));
  }
  free(dev);
  free(bm);
  free(sync);
  if (!(last < 0.1 * first)) {
    fprintf(stderr, "FAIL: the BMUF loss did not fall to a tenth (%.6f -> %.6f)\n", first, last);
    return 1;
  }
  printf("final: BMUF loss %.6f -> %.6f with %zu collectives; synchronous SGD %.6f with %zu\n",
         first, last, blocks, sync_last, step);
  return 0;
}
