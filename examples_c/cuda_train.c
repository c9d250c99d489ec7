/*
 * cuda_train — data-parallel linear regression on CUDA replicas with the caller's streams.
 *
 * Each replica (default: 4 replicas sharing GPU 0) starts from its own random weights in device
 * memory (PARAMs); dpsync_broadcast gives every replica replica 0's. Each step a replica computes
 * its shard's gradient on the host, uploads it into its device gradient buffers (weights and
 * bias: two GRAD tensors fused into one bucket) on its own stream, and dpsync averages the
 * gradients in stream order; the downloads are queued on the same stream right after the
 * collective, with no dpsync_synchronize in between: the events dpsync records make the copies
 * wait. The run is repeated on host replicas and the weights must agree.
 *
 * The CUDA driver is opened with dlopen, so this example builds on machines without CUDA; it
 * exits 77 (CTest: skipped) when there is no driver or no device.
 *
 *   cuda_train [--gpus 0,0,0,0] [--steps S] [--transport auto|nccl|peer_copy]
 */
#include <dpsync.h>

#include "cuda_driver.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { DIM = 64, BIAS = 1, BATCH = 64, MAX_REPLICAS = 16 };

#define DP(call)                                                              \
  do {                                                                        \
    dpsync_status s_ = (call);                                                \
    if (s_ != DPSYNC_STATUS_OK) {                                             \
      fprintf(stderr, "cuda_train.c:%d: %s failed: %s: %s\n", __LINE__, #call, \
              dpsync_status_name((uint32_t)s_), dpsync_last_error());         \
      exit(1);                                                                \
    }                                                                         \
  } while (0)

/* Deterministic data: x in [-1,1), y = w_true . x + 0.5 + small noise. */
static float sample(uint32_t i, uint32_t j) {
  uint32_t h = i * 2654435761u ^ (j + 1) * 40503u;
  h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
  return (float)(h % 20000u) / 10000.0f - 1.0f;
}
static float target(uint32_t i) {
  float y = 0.5f;
  for (uint32_t j = 0; j < DIM; ++j) y += (float)((int)(j % 7) - 3) * 0.1f * sample(i, j);
  return y + 0.01f * sample(i, 999);
}

/* One replica's gradient of the mean squared error over its shard of the step's batch. */
static double shard_grad(const float *w, float *g, int step, int replica, int replicas) {
  int per = BATCH / replicas;
  double loss = 0;
  memset(g, 0, sizeof(float) * (DIM + BIAS));
  for (int k = 0; k < per; ++k) {
    uint32_t i = (uint32_t)(step * BATCH + replica * per + k);
    float pred = w[DIM];
    for (int j = 0; j < DIM; ++j) pred += w[j] * sample(i, (uint32_t)j);
    float err = pred - target(i);
    loss += 0.5 * err * err / per;
    for (int j = 0; j < DIM; ++j) g[j] += err * sample(i, (uint32_t)j) / (float)per;
    g[DIM] += err / (float)per;
  }
  return loss;
}

/* Trains on `replicas` replicas (CUDA when gpus != NULL) and returns the final weights in w. */
static double train(const int32_t *gpus, int replicas, int steps, uint32_t transport, float *w,
                    double *first_loss) {
  dpsync_options *o;
  DP(dpsync_options_new(&o));
  if (gpus) {
    DP(dpsync_options_set_cuda_replicas(o, gpus, (size_t)replicas));
    DP(dpsync_options_set_transport(o, transport));
  } else {
    DP(dpsync_options_set_host_replicas(o, (size_t)replicas));
  }
  dpsync_context *ctx;
  DP(dpsync_context_create(o, &ctx));
  dpsync_options_free(o);

  static float weights[MAX_REPLICAS][DIM + BIAS];
  static float grads[MAX_REPLICAS][DIM + BIAS];
  CUdeviceptr dgrad[MAX_REPLICAS] = {0}, dweights[MAX_REPLICAS] = {0};
  CUstream streams[MAX_REPLICAS] = {0};
  for (int r = 0; r < replicas; ++r) {
    /* Every replica starts elsewhere; the broadcast below must give all of them replica 0's. */
    for (int j = 0; j < DIM + BIAS; ++j) weights[r][j] = 0.1f * sample(7u + (uint32_t)r, (uint32_t)j);
    void *w = weights[r], *gw = grads[r], *gb = grads[r] + DIM;
    if (gpus) {
      use_gpu(gpus[r]);
      CU(cu.mem_alloc(&dgrad[r], sizeof grads[r]));
      CU(cu.mem_alloc(&dweights[r], sizeof weights[r]));
      CU(cu.stream_create(&streams[r], 1 /* non-blocking */));
      CU(cu.htod_async(dweights[r], weights[r], sizeof weights[r], streams[r]));
      DP(dpsync_set_stream(ctx, (size_t)r, streams[r]));
      w = (void *)(uintptr_t)dweights[r];
      gw = (void *)(uintptr_t)dgrad[r];
      gb = (void *)(uintptr_t)(dgrad[r] + DIM * sizeof(float));
    }
    DP(dpsync_register(ctx, "weights", DPSYNC_ROLE_PARAM, (size_t)r, w, DIM + BIAS,
                       DPSYNC_DTYPE_F32));
    DP(dpsync_register(ctx, "w_grad", DPSYNC_ROLE_GRAD, (size_t)r, gw, DIM, DPSYNC_DTYPE_F32));
    DP(dpsync_register(ctx, "b_grad", DPSYNC_ROLE_GRAD, (size_t)r, gb, BIAS, DPSYNC_DTYPE_F32));
  }
  DP(dpsync_broadcast(ctx, DPSYNC_ROLE_PARAM, 0));
  /* The model then trains on the host copy (the gradients are made there); the device copy of
     the weights is what a framework's optimizer would update in place. */
  for (int r = 0; gpus && r < replicas; ++r) {
    /* In stream order after the broadcast (the upload above came before it). */
    CU(cu.dtoh_async(weights[r], dweights[r], sizeof weights[r], streams[r]));
    CU(cu.stream_sync(streams[r]));
  }
  for (int r = 1; r < replicas; ++r) {
    if (memcmp(weights[r], weights[0], sizeof weights[0]) != 0) {
      fprintf(stderr, "after the broadcast, replica %d's weights differ from replica 0's\n", r);
      exit(1);
    }
  }
  double loss = 0;
  for (int step = 0; step < steps; ++step) {
    loss = 0;
    for (int r = 0; r < replicas; ++r) {
      loss += shard_grad(weights[r], grads[r], step, r, replicas) / replicas;
      if (gpus) CU(cu.htod_async(dgrad[r], grads[r], sizeof grads[r], streams[r]));
    }
    DP(dpsync_allreduce_grads(ctx, DPSYNC_REDUCE_AVG));
    for (int r = 0; r < replicas; ++r) {
      if (gpus) {
        /* Queued after the allreduce on the same stream: dpsync's event makes it wait. */
        CU(cu.dtoh_async(grads[r], dgrad[r], sizeof grads[r], streams[r]));
        CU(cu.stream_sync(streams[r]));
      }
      for (int j = 0; j < DIM + BIAS; ++j) weights[r][j] -= 0.1f * grads[r][j];
    }
    if (step == 0) *first_loss = loss;
  }
  for (int r = 1; r < replicas; ++r) {
    if (memcmp(weights[r], weights[0], sizeof weights[0]) != 0) {
      fprintf(stderr, "replica %d's weights differ from replica 0's\n", r);
      exit(1);
    }
  }
  memcpy(w, weights[0], sizeof weights[0]);
  DP(dpsync_context_destroy(ctx));
  for (int r = 0; gpus && r < replicas; ++r) {
    CU(cu.mem_free(dgrad[r]));
    CU(cu.mem_free(dweights[r]));
    CU(cu.stream_destroy(streams[r]));
  }
  return loss;
}

int main(int argc, char **argv) {
  int32_t gpus[MAX_REPLICAS] = {0, 0, 0, 0};
  int replicas = 4, steps = 200;
  uint32_t transport = DPSYNC_TRANSPORT_AUTO;
  for (int i = 1; i + 1 < argc; i += 2) {
    int ok = 1;
    if (!strcmp(argv[i], "--steps")) {
      steps = atoi(argv[i + 1]);
    } else if (!strcmp(argv[i], "--transport")) {
      transport = parse_transport(argv[i + 1], &ok);
    } else if (!strcmp(argv[i], "--gpus")) {
      replicas = (int)parse_gpus(argv[i + 1], gpus, MAX_REPLICAS);
      ok = replicas > 0;
    } else {
      ok = 0;
    }
    if (!ok) {
      fprintf(stderr, "bad argument %s %s\n", argv[i], argv[i + 1]);
      return 2;
    }
  }
  if (replicas < 1 || BATCH % replicas != 0) {
    fprintf(stderr, "the batch of %d must split evenly over %d replicas\n", BATCH, replicas);
    return 2;
  }
  if (!cuda_usable("cuda_train", gpus, (size_t)replicas)) return CUDA_SKIP;

  float w_cuda[DIM + BIAS], w_host[DIM + BIAS];
  double first, first_host;
  double last = train(gpus, replicas, steps, transport, w_cuda, &first);
  double last_host = train(NULL, replicas, steps, transport, w_host, &first_host);
  double diff = 0;
  for (int j = 0; j < DIM + BIAS; ++j) diff = fmax(diff, fabs((double)w_cuda[j] - w_host[j]));
  printf("cuda_train: %d CUDA replicas, %d steps: loss %.5f -> %.5f (host replicas: %.5f -> %.5f), "
         "max weight difference %.3g\n", replicas, steps, first, last, first_host, last_host, diff);
  if (!(last < first * 0.1)) {
    fprintf(stderr, "the loss did not fall\n");
    return 1;
  }
  if (diff > 1e-5) {
    fprintf(stderr, "CUDA and host replicas disagree\n");
    return 1;
  }
  return 0;
}
