/*
 * dpsync-info's parts (tools/): the JSON reader (info_json.c), the run-time library and GPU
 * probes (info_probe.c), the command line (info_args.c); dpsync_info.c has the dpsync calls,
 * the output and main.
 */
#ifndef DPSYNC_INFO_H
#define DPSYNC_INFO_H

#include <stddef.h>
#include <stdint.h>

#define MAX_REPLICAS 4096
#define MAX_GPUS 64

/* Enough JSON for dpsync's describe output: a tree of values, strings with escapes as bytes. */
typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } json_type;
typedef struct json {
  json_type type;
  double num;
  char *str;
  size_t n;
  struct json *items; /* array items, or object values */
  char **keys;        /* object keys */
} json;

typedef struct {
  int found;
  char version[256];
  char path[4096];
  char reason[2048];
  const char *via; /* how it was named: an environment variable, or NULL for the loader path */
  char named[2048]; /* what went wrong with the file a variable names, if anything */
  const char *absent; /* how a missing one is reported: NULL for "not found" */
} probe;

typedef struct {
  int count;
  char reason[512];
  char name[MAX_GPUS][256];
  int cc_major[MAX_GPUS], cc_minor[MAX_GPUS];
  size_t memory[MAX_GPUS]; /* 0: unknown */
  int peer[MAX_GPUS][MAX_GPUS];
} gpus;

typedef struct {
  int32_t cuda[MAX_REPLICAS];
  size_t cuda_n, host_n;
  int have_transport;
  uint32_t transport;
  uint8_t *peer; /* replicas x replicas, or NULL */
  size_t peer_n;
  const char *peer_text;
  int have_fusion;
  size_t fusion_bytes;
  int check, json;
  char described[16384]; /* the options, as a command line */
} args;

/* info_json.c */
int json_parse(const char *text, json *out);
void json_free(json *v);
const json *get(const json *obj, const char *key);
const char *str_of(const json *v);
void print_compact(const json *v);
void put_json_string(const char *s);

/* info_probe.c */
void set_path_of(probe *p, void *symbol);
void probe_driver(probe *p);
void probe_nvrtc(probe *p);
void probe_nccl(probe *p);
void probe_mpi(probe *p, int built_in);
void probe_gpus(gpus *g, const probe *driver);

/* info_args.c */
void bad_usage(const char *fmt, ...);
void append(char *buf, size_t cap, const char *fmt, ...);
void parse_args(int argc, char **argv, args *a);

#endif
