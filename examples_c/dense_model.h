/* The dense demo model shared by train_dense (replicas of one process) and world_train (replicas
 * of a world of processes): a 2-layer MLP (8 -> 16 tanh -> 4 softmax, 212 parameters in 4 tensors)
 * that learns labels produced by a fixed random "teacher" on synthetic, deterministic data, and
 * the weight files the examples save and compare. */
#ifndef DPSYNC_DENSE_MODEL_H
#define DPSYNC_DENSE_MODEL_H

#include "example_util.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { IN = 8, HID = 16, OUT = 4, DATASET = 1024 };

/* Parameter layout inside one contiguous block: --save / --expect and the final bytewise
   comparison then see every parameter at once. */
enum {
  OFF_W1 = 0,
  OFF_B1 = OFF_W1 + IN * HID,
  OFF_W2 = OFF_B1 + HID,
  OFF_B2 = OFF_W2 + HID * OUT,
  N_PARAMS = OFF_B2 + OUT
};

/* Forward order: the library reduces GRAD tensors in reverse registration order, the order
   backward produces them. */
static const struct {
  const char *name;
  const char *grad_name;
  size_t offset;
  size_t count;
  int fan_in; /* > 0: weight, uniform init in +-1/sqrt(fan_in); 0: bias, zero init */
} TENSORS[] = {
    {"fc1_w", "fc1_w_grad", OFF_W1, IN * HID, IN},
    {"fc1_b", "fc1_b_grad", OFF_B1, HID, 0},
    {"fc2_w", "fc2_w_grad", OFF_W2, HID * OUT, HID},
    {"fc2_b", "fc2_b_grad", OFF_B2, OUT, 0},
};
enum { N_TENSORS = sizeof(TENSORS) / sizeof(TENSORS[0]) };

typedef struct {
  float params[N_PARAMS];
  float grads[N_PARAMS];
  double loss; /* this replica's scaled loss; after the allreduce, the global mean loss */
} replica_t;

/* PCG-style 64-bit LCG: the same numbers on every platform, unlike rand(). */
typedef struct {
  uint64_t state;
} lcg_t;

static float lcg_uniform(lcg_t *g, float lo, float hi) {
  g->state = g->state * 6364136223846793005ULL + 1442695040888963407ULL;
  float u = (float)(g->state >> 40) / 16777216.0f; /* top 24 bits: exact in a float, in [0,1) */
  return lo + (hi - lo) * u;
}

/* ------------------------------------------------------------------ data and model */

static float data_x[DATASET][IN];
static int data_y[DATASET];

static void make_dataset(void) {
  lcg_t g = {0x5eed0001ULL};
  float teacher[OUT][IN];
  for (int c = 0; c < OUT; c++)
    for (int i = 0; i < IN; i++) teacher[c][i] = lcg_uniform(&g, -1.0f, 1.0f);
  for (int n = 0; n < DATASET; n++) {
    int best = 0;
    float best_score = -INFINITY;
    for (int i = 0; i < IN; i++) data_x[n][i] = lcg_uniform(&g, -1.0f, 1.0f);
    for (int c = 0; c < OUT; c++) {
      float s = 0.0f;
      for (int i = 0; i < IN; i++) s += teacher[c][i] * data_x[n][i];
      if (s > best_score) {
        best_score = s;
        best = c;
      }
    }
    data_y[n] = best;
  }
}

/* Loss and gradient of `count` samples starting at global position `first`, each sample's
   cross-entropy multiplied by `coef` (= loss_scale / local batch), accumulated into r->grads. */
static void forward_backward(replica_t *r, size_t first, size_t count, double coef) {
  const float *w1 = r->params + OFF_W1, *b1 = r->params + OFF_B1;
  const float *w2 = r->params + OFF_W2, *b2 = r->params + OFF_B2;
  float *gw1 = r->grads + OFF_W1, *gb1 = r->grads + OFF_B1;
  float *gw2 = r->grads + OFF_W2, *gb2 = r->grads + OFF_B2;
  double loss = 0.0;

  memset(r->grads, 0, sizeof r->grads);
  for (size_t s = 0; s < count; s++) {
    const float *x = data_x[(first + s) % DATASET];
    int y = data_y[(first + s) % DATASET];
    float h[HID], logits[OUT], dlogit[OUT], dz[HID];

    for (int k = 0; k < HID; k++) {
      float z = b1[k];
      for (int i = 0; i < IN; i++) z += x[i] * w1[i * HID + k];
      h[k] = tanhf(z);
    }
    float m = -INFINITY;
    for (int c = 0; c < OUT; c++) {
      float o = b2[c];
      for (int k = 0; k < HID; k++) o += h[k] * w2[k * OUT + c];
      logits[c] = o;
      if (o > m) m = o;
    }
    double sum = 0.0;
    for (int c = 0; c < OUT; c++) sum += exp((double)(logits[c] - m));
    double lse = m + log(sum);
    loss += lse - logits[y];

    for (int c = 0; c < OUT; c++) {
      double p = exp(logits[c] - lse);
      dlogit[c] = (float)(coef * (p - (c == y ? 1.0 : 0.0)));
      gb2[c] += dlogit[c];
    }
    for (int k = 0; k < HID; k++) {
      float dh = 0.0f;
      for (int c = 0; c < OUT; c++) {
        gw2[k * OUT + c] += h[k] * dlogit[c];
        dh += w2[k * OUT + c] * dlogit[c];
      }
      dz[k] = dh * (1.0f - h[k] * h[k]);
      gb1[k] += dz[k];
    }
    for (int i = 0; i < IN; i++)
      for (int k = 0; k < HID; k++) gw1[i * HID + k] += x[i] * dz[k];
  }
  r->loss = coef * loss;
}

/* ------------------------------------------------------------------ the library */

/* Registers replica `r`'s params (PARAM), gradients (GRAD) and loss (COMPUTED). */
static void register_replica(dpsync_context *ctx, replica_t *rep, size_t r) {
  for (int t = 0; t < N_TENSORS; t++) {
    CHECK(dpsync_register(ctx, TENSORS[t].name, DPSYNC_ROLE_PARAM, r, rep->params + TENSORS[t].offset,
                          TENSORS[t].count, DPSYNC_DTYPE_F32));
    CHECK(dpsync_register(ctx, TENSORS[t].grad_name, DPSYNC_ROLE_GRAD, r, rep->grads + TENSORS[t].offset,
                          TENSORS[t].count, DPSYNC_DTYPE_F32));
  }
  CHECK(dpsync_register(ctx, "loss", DPSYNC_ROLE_COMPUTED, r, &rep->loss, 1, DPSYNC_DTYPE_F64));
}

/* The initial weights (uniform in +-1/sqrt(fan_in), biases 0), the same on every run. */
static void init_params(float *params) {
  lcg_t g = {0x1234abcdULL};
  for (int t = 0; t < N_TENSORS; t++) {
    float bound = TENSORS[t].fan_in > 0 ? 1.0f / sqrtf((float)TENSORS[t].fan_in) : 0.0f;
    for (size_t i = 0; i < TENSORS[t].count; i++)
      params[TENSORS[t].offset + i] = bound > 0.0f ? lcg_uniform(&g, -bound, bound) : 0.0f;
  }
}

/* Prints dpsync_describe's JSON. */
static void print_plan(dpsync_context *ctx) {
  size_t len = 0;
  CHECK(dpsync_describe(ctx, NULL, 0, &len));
  char *json = malloc(len + 1);
  if (json == NULL) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  CHECK(dpsync_describe(ctx, json, len + 1, &len));
  printf("%s\n", json);
  free(json);
}

/* ------------------------------------------------------------------ weight files */

static void save_weights(const char *path, const float *params) {
  FILE *f = fopen(path, "wb");
  if (f == NULL || fwrite(params, sizeof(float), N_PARAMS, f) != N_PARAMS || fclose(f) != 0) {
    fprintf(stderr, "cannot write %s: %s\n", path, strerror(errno));
    exit(1);
  }
  printf("saved %d parameters to %s\n", (int)N_PARAMS, path);
}

/* Returns 1 if every |w - ref| <= tol * (1 + |ref|). */
static int expect_weights(const char *path, const float *params, double tol) {
  float ref[N_PARAMS];
  FILE *f = fopen(path, "rb");
  if (f == NULL) {
    fprintf(stderr, "cannot open %s: %s\n", path, strerror(errno));
    return 0;
  }
  size_t got = fread(ref, sizeof(float), N_PARAMS, f);
  int extra = fgetc(f) != EOF;
  fclose(f);
  if (got != N_PARAMS || extra) {
    fprintf(stderr, "%s: expected exactly %d f32 values\n", path, (int)N_PARAMS);
    return 0;
  }
  double max_diff = 0.0;
  int bad = 0;
  for (int i = 0; i < N_PARAMS; i++) {
    double d = fabs((double)params[i] - (double)ref[i]);
    if (d > max_diff) max_diff = d;
    if (!(d <= tol * (1.0 + fabs((double)ref[i])))) {
      if (bad < 5) fprintf(stderr, "  param %d: %.9g vs reference %.9g\n", i, params[i], ref[i]);
      bad++;
    }
  }
  printf("compared with %s: max |diff| %.3g, %d of %d outside tol %g\n", path, max_diff, bad,
         (int)N_PARAMS, tol);
  return bad == 0;
}

#endif
