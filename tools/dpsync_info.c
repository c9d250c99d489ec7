/*
 * dpsync-info — what this machine offers dpsync, and the plan dpsync makes for a set of replicas.
 *
 * Prints the library's version and build (MPI or not), the run-time libraries dpsync would load
 * (CUDA driver, NVRTC, NCCL, MPI: version and path, or why not found), the GPUs and which pairs
 * have peer access, and the allreduce plan dpsync_plan_describe gives for the options (a dry run
 * that touches no device). --check also creates a context with those options, as a program
 * would, and prints what dpsync chose, or its error (exit 1).
 *
 *   dpsync-info [--cuda 0,0,1 | --host N] [--transport auto|nccl|peer_copy|host]
 *               [--peer-access 1,0,0/0,1,1/0,1,1] [--fusion-bytes N] [--check] [--json]
 *
 * Uses only dpsync's public API; the run-time libraries are opened here by the names dpsync uses
 * (docs/API.md, "CUDA libraries"). Exit codes: 0, 1 (--check failed),
 * 2 (bad arguments, usage on stderr).
 */
#define _GNU_SOURCE
#include <dpsync.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dpsync_info.h"

/* ------------------------------------------------------------------ dpsync calls */

/* The status's name and dpsync's message, for a failed call. */
static void failure(char *out, size_t cap, const char *call, dpsync_status s) {
  snprintf(out, cap, "%s: %s: %s", call, dpsync_status_name((uint32_t)s), dpsync_last_error());
}

/* Options from the arguments; NULL with `error` set when dpsync refuses one. */
static dpsync_options *make_options(const args *a, char *error, size_t cap) {
  dpsync_options *o = NULL;
  dpsync_status s = dpsync_options_new(&o);
  if (s != DPSYNC_STATUS_OK) return failure(error, cap, "dpsync_options_new", s), NULL;
#define TRY(fn, ...)                           \
  do {                                         \
    s = fn(__VA_ARGS__);                       \
    if (s != DPSYNC_STATUS_OK) {               \
      failure(error, cap, #fn, s);             \
      dpsync_options_free(o);                  \
      return NULL;                             \
    }                                          \
  } while (0)
  if (a->cuda_n) TRY(dpsync_options_set_cuda_replicas, o, a->cuda, a->cuda_n);
  if (a->host_n) TRY(dpsync_options_set_host_replicas, o, a->host_n);
  if (a->have_transport) TRY(dpsync_options_set_transport, o, a->transport);
  if (a->have_fusion) TRY(dpsync_options_set_fusion_bytes, o, a->fusion_bytes);
  if (a->peer) TRY(dpsync_options_set_peer_access, o, a->peer, a->peer_n);
#undef TRY
  return o;
}

/* The whole JSON text of dpsync_plan_describe / dpsync_describe (sized first), or NULL. */
static char *describe_text(dpsync_status (*fn)(const void *, char *, size_t, size_t *),
                           const void *object, const char *call, char *error, size_t cap) {
  size_t len = 0;
  dpsync_status s = fn(object, NULL, 0, &len);
  if (s != DPSYNC_STATUS_OK) return failure(error, cap, call, s), NULL;
  char *text = malloc(len + 1);
  if (!text) exit(1);
  s = fn(object, text, len + 1, &len);
  if (s != DPSYNC_STATUS_OK) {
    free(text);
    return failure(error, cap, call, s), NULL;
  }
  return text;
}

static dpsync_status plan_describe(const void *o, char *b, size_t c, size_t *l) {
  return dpsync_plan_describe((const dpsync_options *)o, b, c, l);
}
static dpsync_status context_describe(const void *x, char *b, size_t c, size_t *l) {
  return dpsync_describe((const dpsync_context *)x, b, c, l);
}

/* ------------------------------------------------------------------ tables */

static void print_probe(const char *what, const probe *p) {
  if (p->found) {
    printf("  %-12s %-10s %s%s%s%s\n", what, p->version[0] ? p->version : "?", p->path,
           p->via ? " (" : "", p->via ? p->via : "", p->via ? ")" : "");
  } else {
    printf("  %-12s %s: %s\n", what, p->absent ? p->absent : "not found", p->reason);
  }
  if (p->named[0]) printf("  %-12s note: %s\n", "", p->named);
}

static void print_matrix(const char *indent, size_t n, int (*at)(const void *, size_t, size_t),
                         const void *m) {
  printf("%s    ", indent);
  for (size_t j = 0; j < n; j++) printf(" %3zu", j);
  printf("\n");
  for (size_t i = 0; i < n; i++) {
    printf("%s%3zu ", indent, i);
    for (size_t j = 0; j < n; j++) printf(" %3d", at(m, i, j) ? 1 : 0);
    printf("\n");
  }
}

static int gpu_peer_at(const void *m, size_t i, size_t j) {
  return ((const gpus *)m)->peer[i][j];
}
static int json_matrix_at(const void *m, size_t i, size_t j) {
  const json *row = &((const json *)m)->items[i];
  return j < row->n && row->items[j].num != 0;
}

static void print_gpus(const gpus *g) {
  printf("\nGPUs\n");
  if (g->count == 0) {
    printf("  no CUDA device: %s\n", g->reason);
    return;
  }
  printf("  %-4s %-40s %-8s %s\n", "GPU", "name", "compute", "memory");
  for (int i = 0; i < g->count; i++) {
    char memory[32] = "?";
    if (g->memory[i])
      snprintf(memory, sizeof memory, "%.1f GiB", (double)g->memory[i] / (1024.0 * 1024 * 1024));
    printf("  %-4d %-40s %d.%-6d %s\n", i, g->name[i], g->cc_major[i], g->cc_minor[i], memory);
  }
  printf("  peer access (row GPU reads column GPU's memory directly; cuDeviceCanAccessPeer):\n");
  print_matrix("  ", (size_t)g->count, gpu_peer_at, g);
}

static void print_levels(const json *levels) {
  if (!levels || levels->type != J_ARR) return;
  for (size_t i = 0; i < levels->n; i++) {
    const json *l = &levels->items[i];
    printf(i ? "                " : "  levels        ");
    printf("%s:", str_of(get(l, "level")));
    for (size_t k = 0; l->type == J_OBJ && k < l->n; k++) {
      if (strcmp(l->keys[k], "level") == 0) continue;
      printf(" %s ", l->keys[k]);
      print_compact(&l->items[k]);
    }
    printf("\n");
  }
}

static void print_plan(const json *plan, const char *options) {
  const json *replicas = get(plan, "replicas");
  printf("\nplan for %s (dpsync_plan_describe: a dry run, no device touched)\n", options);
  printf("  replicas      ");
  for (size_t i = 0; replicas && i < replicas->n; i++) {
    const json *r = &replicas->items[i];
    const json *rank = get(r, "rank");
    printf("%s%g:%s", i ? "  " : "", get(r, "index") ? get(r, "index")->num : (double)i,
           str_of(get(r, "device")));
    if (rank && rank->num != 0) printf("@rank%g", rank->num);
  }
  printf("\n  transport     %s: %s\n", str_of(get(plan, "transport")),
         str_of(get(plan, "transport_reason")));
  const json *peer = get(plan, "peer_access");
  if (peer && peer->type == J_ARR && peer->n) {
    printf("  peer access   %s (row replica reads column replica's memory directly)\n",
           str_of(get(plan, "peer_access_source")));
    print_matrix("              ", peer->n, json_matrix_at, peer);
  }
  const json *fusion = get(plan, "fusion_bytes"), *scale = get(plan, "loss_scale");
  if (fusion) printf("  fusion        %.0f bytes per bucket%s\n", fusion->num, fusion->num ? "" : " (no fusion)");
  if (scale) printf("  loss scale    %.6g\n", scale->num);
  print_levels(get(plan, "levels"));
  const json *problems = get(plan, "problems");
  for (size_t i = 0; problems && i < problems->n; i++)
    printf("  problem       %s\n", str_of(&problems->items[i]));
  const json *steps = get(plan, "steps");
  printf("  allreduce steps (ops of one round are independent)\n");
  printf("    %-6s %-15s %4s %4s  %s\n", "round", "op", "src", "dst", "via");
  for (size_t i = 0; steps && i < steps->n; i++) {
    const json *s = &steps->items[i];
    const json *rank = get(s, "rank");
    printf("    %-6g %-15s %4g %4g  %s", get(s, "round") ? get(s, "round")->num : 0,
           str_of(get(s, "op")), get(s, "src") ? get(s, "src")->num : -1,
           get(s, "dst") ? get(s, "dst")->num : -1, str_of(get(s, "via")));
    if (rank) printf(" (NCCL rank %g)", rank->num);
    printf("\n");
  }
  if (!steps || steps->n == 0) printf("    (none: one replica)\n");
}

static void print_check(const json *d) {
  printf("  %-19s %s: %s\n", "created", str_of(get(d, "transport")),
         str_of(get(d, "transport_reason")));
  const json *backend = get(d, "backend");
  for (size_t k = 0; backend && backend->type == J_OBJ && k < backend->n; k++) {
    const json *v = &backend->items[k];
    if (v->type == J_ARR) {
      for (size_t i = 0; i < v->n; i++) {
        printf("  %-19s ", i ? "" : backend->keys[k]);
        print_compact(&v->items[i]);
        printf("\n");
      }
    } else {
      printf("  %-19s ", backend->keys[k]);
      print_compact(v);
      printf("\n");
    }
  }
}

/* ------------------------------------------------------------------ JSON output */

static void put_probe(const char *key, const probe *p, int last) {
  printf("    ");
  put_json_string(key);
  printf(": {\"found\": %s", p->found ? "true" : "false");
  if (p->found) {
    printf(", \"version\": ");
    put_json_string(p->version);
    printf(", \"path\": ");
    put_json_string(p->path);
    if (p->via) {
      printf(", \"named_by\": ");
      put_json_string(p->via);
    }
  } else {
    printf(", \"reason\": ");
    put_json_string(p->reason);
  }
  if (p->named[0]) {
    printf(", \"note\": ");
    put_json_string(p->named);
  }
  printf("}%s\n", last ? "" : ",");
}

/* ------------------------------------------------------------------ main */

int main(int argc, char **argv) {
  args a = {0};
  parse_args(argc, argv, &a);

  /* The library itself. */
  char header_version[32];
  snprintf(header_version, sizeof header_version, "%d.%d.%d", DPSYNC_VERSION_MAJOR,
           DPSYNC_VERSION_MINOR, DPSYNC_VERSION_PATCH);
  probe self = {0};
  const char *(*version_fn)(void) = dpsync_version;
  set_path_of(&self, *(void **)&version_fn);
  char error[4096] = "";
  /* Setting a world is refused with UNAVAILABLE by a build without MPI; NULL names
   * MPI_COMM_WORLD and initialises nothing yet. */
  dpsync_options *probe_options = NULL;
  int mpi_built_in = 0;
  if (dpsync_options_new(&probe_options) == DPSYNC_STATUS_OK) {
    mpi_built_in = dpsync_options_set_world_mpi(probe_options, NULL) == DPSYNC_STATUS_OK;
    dpsync_options_free(probe_options);
  }

  probe driver = {0}, nvrtc = {0}, nccl = {0}, mpi = {0};
  probe_driver(&driver);
  probe_nvrtc(&nvrtc);
  probe_nccl(&nccl);
  probe_mpi(&mpi, mpi_built_in);
  static gpus g;
  probe_gpus(&g, &driver);

  /* Default replicas: one per GPU found, else two on the host. */
  if (!a.cuda_n && !a.host_n) {
    if (g.count) {
      for (int i = 0; i < g.count; i++) a.cuda[a.cuda_n++] = i;
    } else {
      a.host_n = 2;
    }
  }
  if (a.cuda_n) {
    append(a.described, sizeof a.described, "--cuda ");
    for (size_t i = 0; i < a.cuda_n; i++)
      append(a.described, sizeof a.described, "%s%d", i ? "," : "", a.cuda[i]);
  } else {
    append(a.described, sizeof a.described, "--host %zu", a.host_n);
  }
  if (a.have_transport) {
    static const char *const names[] = {"auto", "nccl", "peer_copy", "host"};
    append(a.described, sizeof a.described, " --transport %s", names[a.transport]);
  }
  /* Without --peer-access, CUDA replicas on GPUs found here are planned with the access the
   * driver reports (the dry run would otherwise assume none between distinct GPUs). */
  static char detected[8192];
  if (!a.peer && a.cuda_n && a.cuda_n <= 64) {
    int known = 1;
    for (size_t i = 0; i < a.cuda_n; i++) known &= a.cuda[i] < g.count;
    if (known) {
      a.peer = malloc(a.cuda_n * a.cuda_n);
      if (!a.peer) exit(1);
      a.peer_n = a.cuda_n;
      for (size_t i = 0; i < a.cuda_n; i++)
        for (size_t j = 0; j < a.cuda_n; j++) {
          int on = a.cuda[i] == a.cuda[j] || g.peer[a.cuda[i]][a.cuda[j]];
          a.peer[i * a.cuda_n + j] = (uint8_t)on;
          append(detected, sizeof detected, "%s%d", j ? "," : i ? "/" : "", on);
        }
      a.peer_text = detected;
    }
  }
  if (a.peer) append(a.described, sizeof a.described, " --peer-access %s", a.peer_text);
  if (a.have_fusion) append(a.described, sizeof a.described, " --fusion-bytes %zu", a.fusion_bytes);

  dpsync_options *options = make_options(&a, error, sizeof error);
  char *plan_text = options ? describe_text(plan_describe, options, "dpsync_plan_describe", error,
                                            sizeof error)
                            : NULL;
  if (!plan_text) {
    /* The options do not fit together (dpsync says why): a usage error. */
    dpsync_options_free(options);
    free(a.peer);
    bad_usage("%s", error);
  }
  json plan;
  if (!json_parse(plan_text, &plan)) {
    fprintf(stderr, "dpsync-info: dpsync_plan_describe wrote JSON this program cannot read\n");
    return 1;
  }

  /* --check: a context, as a program would create it. */
  int check_ok = 0;
  char *check_text = NULL;
  char check_error[4096] = "";
  if (a.check) {
    dpsync_context *ctx = NULL;
    dpsync_status s = dpsync_context_create(options, &ctx);
    if (s != DPSYNC_STATUS_OK) {
      failure(check_error, sizeof check_error, "dpsync_context_create", s);
    } else {
      check_text = describe_text(context_describe, ctx, "dpsync_describe", check_error,
                                 sizeof check_error);
      check_ok = check_text != NULL;
      dpsync_context_destroy(ctx);
    }
  }
  dpsync_options_free(options);

  if (a.json) {
    printf("{\n  \"version\": ");
    put_json_string(dpsync_version());
    printf(",\n  \"header_version\": ");
    put_json_string(header_version);
    printf(",\n  \"library\": ");
    put_json_string(self.path);
    printf(",\n  \"mpi\": %s,\n  \"libraries\": {\n", mpi_built_in ? "true" : "false");
    put_probe("cuda_driver", &driver, 0);
    put_probe("nvrtc", &nvrtc, 0);
    put_probe("nccl", &nccl, 0);
    put_probe("mpi", &mpi, 1);
    printf("  },\n  \"gpus\": [");
    for (int i = 0; i < g.count; i++) {
      printf("%s\n    {\"index\": %d, \"name\": ", i ? "," : "", i);
      put_json_string(g.name[i]);
      printf(", \"compute_capability\": \"%d.%d\", \"memory_bytes\": %zu, \"peer_access\": [",
             g.cc_major[i], g.cc_minor[i], g.memory[i]);
      for (int j = 0; j < g.count; j++) printf("%s%d", j ? ", " : "", g.peer[i][j]);
      printf("]}");
    }
    printf("%s],\n", g.count ? "\n  " : "");
    if (!g.count) {
      printf("  \"gpus_reason\": ");
      put_json_string(g.reason);
      printf(",\n");
    }
    printf("  \"options\": ");
    put_json_string(a.described);
    printf(",\n  \"plan\": %s", plan_text);
    if (a.check) {
      printf(",\n  \"check\": {\"ok\": %s, ", check_ok ? "true" : "false");
      if (check_ok) {
        printf("\"describe\": %s}", check_text);
      } else {
        printf("\"error\": ");
        put_json_string(check_error);
        printf("}");
      }
    }
    printf("\n}\n");
  } else {
    printf("dpsync %s\n", dpsync_version());
    printf("  library      %s\n", self.path[0] ? self.path : "(linked into this program)");
    printf("  header       %s%s\n", header_version,
           strcmp(header_version, dpsync_version()) == 0 ? "" : " (differs from the library)");
    printf("  MPI worlds   %s\n", mpi_built_in ? "built in" : "not built in");
    printf("\nrun-time libraries (found as dpsync finds them; docs/API.md, \"CUDA libraries\")\n");
    print_probe("CUDA driver", &driver);
    print_probe("NVRTC", &nvrtc);
    print_probe("NCCL", &nccl);
    print_probe("MPI", &mpi);
    print_gpus(&g);
    print_plan(&plan, a.described);
    if (a.check) {
      printf("\ncheck: dpsync_context_create with %s\n", a.described);
      json d;
      if (check_ok && json_parse(check_text, &d)) {
        print_check(&d);
        json_free(&d);
      } else {
        printf("  %-19s %s\n", "failed", check_error[0] ? check_error : "unreadable JSON");
      }
    }
  }
  json_free(&plan);
  free(plan_text);
  free(check_text);
  free(a.peer);
  return a.check && !check_ok ? 1 : 0;
}
