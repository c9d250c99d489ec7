/* Ways to move what the MPI engine moves, in plain C against Open MPI (2 ranks), for the design
 * figures of docs/PERFORMANCE.md ("Worlds over MPI"). Not built by cargo:
 *
 *   mpicc -O2 -pthread benches/mpi_pieces.c -o /tmp/mpi_pieces
 *   mpirun --allow-run-as-root --oversubscribe -n 2 /tmp/mpi_pieces [large|small]
 *
 * large: an allreduce (sum) of the ResNet-50 gradient set (25.6 M f32, benches/data) — one
 * MPI_Allreduce, 161 (one per tensor), both also with MPI_IN_PLACE, blocking MPI_Allreduce in pieces on the caller's buffers,
 * the same through a small stage per piece, the same on a helper thread (the caller waiting on a
 * condition variable), the engine's former way (the whole buffer staged, MPI_Iallreduce in
 * pieces, 4 in flight), MPI_Iallreduce pieces on the caller's buffers, the engine's way now
 * (each piece staged in just before its MPI_Iallreduce and out as it completes, through DEPTH
 * small stages), a ring reduce-scatter + allgather over MPI_Isend/MPI_Irecv summing on the
 * host (one piece at a time, and pipelined as the engine runs it), and the pairwise exchange of
 * two ranks (staged, or sending from the caller's buffer), the same pieces through a shared-memory
 * window with the ranks' own sum, and the floor of any staged way (each piece copied to a slot
 * and back, no peer).
 * Then a broadcast of the same bytes: blocking, whole-staged MPI_Ibcast, staged pieces.
 * small: a 256-byte allgather (the agreement record): MPI_Iallgather polled, MPI_Allgather,
 * Bruck's allgather over MPI_Isend/MPI_Irecv polled, and a raw 1-float MPI_Allreduce.
 * Medians of 7 alternating repetitions, each started by a barrier; rank 0 prints. */
#include <mpi.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TENSORS 161
#define KIB 1024
static size_t N;
static int sizes[TENSORS];
static int rank, size;
static float *src, *dst, *whole_s, *whole_r, *st[8][2];

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void wait_on(MPI_Request *q) {
  int done = 0;
  while (!done) MPI_Test(q, &done, MPI_STATUS_IGNORE);
}

static void wait_all(MPI_Request *q) {
  int done = 0;
  while (!done) MPI_Testall(2, q, &done, MPI_STATUSES_IGNORE);
}

static size_t len_of(size_t at, size_t p) { return N - at < p ? N - at : p; }

static void one_call(size_t piece, int depth) {
  (void)piece, (void)depth;
  MPI_Allreduce(src, dst, (int)N, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
}

static void per_tensor(size_t piece, int depth) {
  (void)piece, (void)depth;
  size_t at = 0;
  for (int i = 0; i < TENSORS; i++) {
    MPI_Allreduce(src + at, dst + at, sizes[i], MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    at += sizes[i];
  }
}

static void one_call_in_place(size_t piece, int depth) {
  (void)piece, (void)depth;
  MPI_Allreduce(MPI_IN_PLACE, dst, (int)N, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
}

static void per_tensor_in_place(size_t piece, int depth) {
  (void)piece, (void)depth;
  size_t at = 0;
  for (int i = 0; i < TENSORS; i++) {
    MPI_Allreduce(MPI_IN_PLACE, dst + at, sizes[i], MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    at += sizes[i];
  }
}

static void blocking_pieces(size_t piece, int depth) {
  (void)depth;
  for (size_t at = 0; at < N; at += piece)
    MPI_Allreduce(src + at, dst + at, (int)len_of(at, piece), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
}

static void blocking_staged(size_t piece, int depth) {
  (void)depth;
  for (size_t at = 0; at < N; at += piece) {
    size_t n = len_of(at, piece);
    memcpy(st[0][0], src + at, n * 4);
    MPI_Allreduce(st[0][0], st[0][1], (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    memcpy(dst + at, st[0][1], n * 4);
  }
}

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t posted = PTHREAD_COND_INITIALIZER, finished = PTHREAD_COND_INITIALIZER;
static int job, done;
static size_t job_piece;

static void *helper(void *unused) {
  (void)unused;
  for (;;) {
    pthread_mutex_lock(&mu);
    while (!job) pthread_cond_wait(&posted, &mu);
    job = 0;
    pthread_mutex_unlock(&mu);
    blocking_staged(job_piece, 1);
    pthread_mutex_lock(&mu);
    done = 1;
    pthread_cond_signal(&finished);
    pthread_mutex_unlock(&mu);
  }
  return NULL;
}

static void on_helper(size_t piece, int depth) {
  (void)depth;
  pthread_mutex_lock(&mu);
  job_piece = piece, job = 1, done = 0;
  pthread_cond_signal(&posted);
  while (!done) pthread_cond_wait(&finished, &mu);
  pthread_mutex_unlock(&mu);
}

/* MPI_Iallreduce pieces of `s` into `r`, `depth` in flight. */
static void ipieces(float *s, float *r, size_t piece, int depth) {
  MPI_Request q[8];
  size_t pieces = (N + piece - 1) / piece;
  for (size_t i = 0; i < pieces + depth; i++) {
    if (i >= (size_t)depth) wait_on(&q[(i - depth) % depth]);
    if (i < pieces) {
      size_t at = i * piece;
      MPI_Iallreduce(s + at, r + at, (int)len_of(at, piece), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD,
                     &q[i % depth]);
    }
  }
}

static void whole_staged(size_t piece, int depth) {
  memcpy(whole_s, src, N * 4);
  ipieces(whole_s, whole_r, piece, depth);
  memcpy(dst, whole_r, N * 4);
}

static void caller_buffers(size_t piece, int depth) { ipieces(src, dst, piece, depth); }

static void staged_pieces(size_t piece, int depth) {
  MPI_Request q[8];
  size_t pieces = (N + piece - 1) / piece;
  for (size_t i = 0; i < pieces + depth; i++) {
    if (i >= (size_t)depth) {
      size_t k = i - depth, at = k * piece;
      wait_on(&q[k % depth]);
      memcpy(dst + at, st[k % depth][1], len_of(at, piece) * 4);
    }
    if (i < pieces) {
      size_t at = i * piece, n = len_of(at, piece);
      memcpy(st[i % depth][0], src + at, n * 4);
      MPI_Iallreduce(st[i % depth][0], st[i % depth][1], (int)n, MPI_FLOAT, MPI_SUM,
                     MPI_COMM_WORLD, &q[i % depth]);
    }
  }
}

/* Block b of n elements split in `size` blocks. */
static void block(size_t n, int b, size_t *off, size_t *len) {
  size_t base = n / size, rem = n % size;
  *off = b * base + ((size_t)b < rem ? (size_t)b : rem);
  *len = base + ((size_t)b < rem);
}

/* Ring reduce-scatter then allgather of each staged piece, pieces one after another. */
static void ring(size_t piece, int depth) {
  (void)depth;
  int right = (rank + 1) % size, left = (rank + size - 1) % size;
  float *work = st[0][0], *tmp = st[0][1];
  for (size_t at = 0; at < N; at += piece) {
    size_t n = len_of(at, piece);
    memcpy(work, src + at, n * 4);
    for (int step = 0; step < 2 * (size - 1); step++) {
      int reduce = step < size - 1, a = reduce ? step : step - (size - 1);
      int out = reduce ? rank - a : rank + 1 - a, in = reduce ? rank - a - 1 : rank - a;
      size_t so, sl, ro, rl;
      block(n, ((out % size) + size) % size, &so, &sl);
      block(n, ((in % size) + size) % size, &ro, &rl);
      MPI_Request q[2];
      MPI_Irecv(reduce ? tmp : work + ro, (int)rl, MPI_FLOAT, left, 7, MPI_COMM_WORLD, &q[0]);
      MPI_Isend(work + so, (int)sl, MPI_FLOAT, right, 7, MPI_COMM_WORLD, &q[1]);
      wait_on(&q[0]);
      wait_on(&q[1]);
      if (reduce)
        for (size_t i = 0; i < rl; i++) work[ro + i] += tmp[i];
    }
    memcpy(dst + at, work, n * 4);
  }
}

/* The same ring as the engine runs it: `depth` pieces in flight, each advanced a step as its
 * sends and receives complete (all flights tested in turn), out in piece order. */
typedef struct {
  size_t at, n;
  int step, slot;
  MPI_Request q[2];
} Flight;

static void ring_issue(Flight *f) {
  int right = (rank + 1) % size, left = (rank + size - 1) % size, s = f->step;
  int reduce = s < size - 1, a = reduce ? s : s - (size - 1);
  int out = reduce ? rank - a : rank + 1 - a, in = reduce ? rank - a - 1 : rank - a;
  size_t so, sl, ro, rl;
  block(f->n, ((out % size) + size) % size, &so, &sl);
  block(f->n, ((in % size) + size) % size, &ro, &rl);
  float *work = st[f->slot][0], *tmp = st[f->slot][1];
  MPI_Irecv(reduce ? tmp : work + ro, (int)rl, MPI_FLOAT, left, 20 + f->slot, MPI_COMM_WORLD,
            &f->q[0]);
  MPI_Isend(work + so, (int)sl, MPI_FLOAT, right, 20 + f->slot, MPI_COMM_WORLD, &f->q[1]);
}

static void ring_pipelined(size_t piece, int depth) {
  Flight fl[8];
  int head = 0, count = 0, steps = 2 * (size - 1);
  size_t next = 0;
  while (next < N || count > 0) {
    while (count < depth && next < N) {
      Flight *f = &fl[(head + count) % depth];
      f->at = next, f->n = len_of(next, piece), f->step = 0, f->slot = (head + count) % depth;
      memcpy(st[f->slot][0], src + f->at, f->n * 4);
      ring_issue(f);
      count++, next += piece;
    }
    for (int k = 0; k < count; k++) {
      Flight *f = &fl[(head + k) % depth];
      int done = 0;
      if (f->step == steps) continue;
      MPI_Testall(2, f->q, &done, MPI_STATUSES_IGNORE);
      if (!done) continue;
      if (f->step < size - 1) {
        int in = rank - f->step - 1;
        size_t ro, rl;
        block(f->n, ((in % size) + size) % size, &ro, &rl);
        float *work = st[f->slot][0], *tmp = st[f->slot][1];
        for (size_t i = 0; i < rl; i++) work[ro + i] += tmp[i];
      }
      if (++f->step < steps) ring_issue(f);
    }
    while (count > 0 && fl[head].step == steps) {
      memcpy(dst + fl[head].at, st[fl[head].slot][0], fl[head].n * 4);
      head = (head + 1) % depth, count--;
    }
  }
}

/* 2 ranks: each piece sent to the peer while the peer's is received, then both summed in rank
 * order on each rank (the same bytes on both), `depth` pieces in flight; the send staged, or
 * straight from the caller's buffer. */
static void exchange(size_t piece, int depth, int staged) {
  int peer = 1 - rank;
  MPI_Request q[8][2];
  size_t pieces = (N + piece - 1) / piece;
  for (size_t i = 0; i < pieces + depth; i++) {
    if (i >= (size_t)depth) {
      size_t k = i - depth, at = k * piece, n = len_of(at, piece);
      int s = k % depth;
      wait_all(q[s]);
      float *mine = staged ? st[s][0] : src + at, *theirs = st[s][1];
      float *a = rank == 0 ? mine : theirs, *b = rank == 0 ? theirs : mine;
      for (size_t j = 0; j < n; j++) dst[at + j] = a[j] + b[j];
    }
    if (i < pieces) {
      size_t at = i * piece, n = len_of(at, piece);
      int s = i % depth;
      float *send = src + at;
      if (staged) send = memcpy(st[s][0], src + at, n * 4);
      MPI_Irecv(st[s][1], (int)n, MPI_FLOAT, peer, 9, MPI_COMM_WORLD, &q[s][0]);
      MPI_Isend(send, (int)n, MPI_FLOAT, peer, 9, MPI_COMM_WORLD, &q[s][1]);
    }
  }
}

static void pairwise(size_t piece, int depth) { exchange(piece, depth, 1); }
static void pairwise_unstaged(size_t piece, int depth) { exchange(piece, depth, 0); }


/* Ranks on one host through a shared-memory window (MPI_Win_allocate_shared), as the engine's
 * shared-memory path does: each rank copies a piece of the caller's buffer into its own slot,
 * sums its block of the piece from every rank's slot into its slot, then copies the others'
 * summed blocks out; per-rank counters, polled, say how far each rank got. No MPI call moves
 * data. `depth` pieces in flight; in place (the caller's buffer read and written, as
 * MPI_IN_PLACE), or through a private stage on either side (the extra copies cost). */
typedef struct {
  volatile long in, red, out;
  char pad[64 - 3 * sizeof(long)];
} Flags;
static Flags *flags[64];
static float *slots[64];
static long shm_seq;

static void shm_setup(void) {
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  MPI_Win win;
  char *base;
  MPI_Aint bytes = 64 + 8 * (4 << 20);
  MPI_Win_allocate_shared(bytes, 64, MPI_INFO_NULL, node, &base, &win);
  for (int r = 0; r < size; r++) {
    MPI_Aint len;
    int unit;
    char *at;
    MPI_Win_shared_query(win, r, &len, &unit, &at);
    flags[r] = (Flags *)at, slots[r] = (float *)(at + 64);
  }
  memset(base, 0, bytes);
  MPI_Barrier(MPI_COMM_WORLD);
}

static long least(int which) {
  long m = -1;
  for (int r = 0; r < size; r++) {
    long v = __atomic_load_n(which == 0 ? &flags[r]->in : which == 1 ? &flags[r]->red : &flags[r]->out,
                             __ATOMIC_ACQUIRE);
    if (m < 0 || v < m) m = v;
  }
  return m;
}

static void shm_run(float *from, size_t piece, int depth, int staged) {
  size_t pieces = (N + piece - 1) / piece, slot = (4 << 20) / 4 / depth;
  long first = shm_seq;
  size_t started = 0, reduced = 0, out = 0;
  while (out < pieces) {
    /* start: my slot is free once every rank copied piece k - depth out */
    while (started < pieces && started < out + depth && least(2) >= first + (long)started - depth + 1) {
      size_t at = started * piece, n = len_of(at, piece);
      float *stage = st[started % depth][0];
      if (staged) memcpy(stage, from + at, n * 4);
      memcpy(slots[rank] + (started % depth) * slot, staged ? stage : from + at, n * 4);
      __atomic_store_n(&flags[rank]->in, first + started + 1, __ATOMIC_RELEASE);
      started++;
    }
    if (reduced < started && least(0) >= first + (long)reduced + 1) {
      size_t n = len_of(reduced * piece, piece), o, l;
      block(n, rank, &o, &l);
      float *mine = slots[rank] + (reduced % depth) * slot + o;
      for (int r = 0; r < size; r++)
        if (r != rank) {
          float *theirs = slots[r] + (reduced % depth) * slot + o;
          for (size_t i = 0; i < l; i++) mine[i] += theirs[i];
        }
      __atomic_store_n(&flags[rank]->red, first + reduced + 1, __ATOMIC_RELEASE);
      reduced++;
    }
    if (out < reduced && least(1) >= first + (long)out + 1) {
      size_t at = out * piece, n = len_of(at, piece);
      for (int r = 0; r < size; r++) {
        size_t o, l;
        block(n, r, &o, &l);
        memcpy((staged ? st[out % depth][0] : dst + at) + o, slots[r] + (out % depth) * slot + o, l * 4);
      }
      if (staged) memcpy(dst + at, st[out % depth][0], n * 4);
      __atomic_store_n(&flags[rank]->out, first + out + 1, __ATOMIC_RELEASE);
      out++;
    }
  }
  shm_seq = first + pieces;
}

/* The floor of any staged way on this machine: each piece copied into a slot and back, no peer. */
static void floor_copies(size_t piece, int depth) {
  for (size_t at = 0, k = 0; at < N; at += piece, k++) {
    float *slot = slots[rank] + (k % depth) * ((4 << 20) / 4 / depth);
    memcpy(slot, dst + at, len_of(at, piece) * 4);
    memcpy(dst + at, slot, len_of(at, piece) * 4);
  }
}

static void shm_in_place(size_t piece, int depth) { shm_run(dst, piece, depth, 0); }
static void shm_staged(size_t piece, int depth) { shm_run(dst, piece, depth, 1); }

static void bcast_blocking(size_t piece, int depth) {
  (void)piece, (void)depth;
  MPI_Bcast(rank == 0 ? src : dst, (int)N, MPI_FLOAT, 0, MPI_COMM_WORLD);
}

static void bcast_whole(size_t piece, int depth) {
  (void)piece, (void)depth;
  MPI_Request q;
  if (rank == 0) memcpy(whole_s, src, N * 4);
  MPI_Ibcast(whole_s, (int)N, MPI_FLOAT, 0, MPI_COMM_WORLD, &q);
  wait_on(&q);
  if (rank != 0) memcpy(dst, whole_s, N * 4);
}

static void bcast_pieces(size_t piece, int depth) {
  MPI_Request q[8];
  size_t pieces = (N + piece - 1) / piece;
  for (size_t i = 0; i < pieces + depth; i++) {
    if (i >= (size_t)depth) {
      size_t k = i - depth, at = k * piece;
      wait_on(&q[k % depth]);
      if (rank != 0) memcpy(dst + at, st[k % depth][0], len_of(at, piece) * 4);
    }
    if (i < pieces) {
      size_t at = i * piece, n = len_of(at, piece);
      if (rank == 0) memcpy(st[i % depth][0], src + at, n * 4);
      MPI_Ibcast(st[i % depth][0], (int)n, MPI_FLOAT, 0, MPI_COMM_WORLD, &q[i % depth]);
    }
  }
}

static char record[256], records[256 * 64];

static void raw_one_float(void) {
  float x = 1, y;
  MPI_Allreduce(&x, &y, 1, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
}

static void iallgather(void) {
  MPI_Request q;
  MPI_Iallgather(record, 256, MPI_BYTE, records, 256, MPI_BYTE, MPI_COMM_WORLD, &q);
  wait_on(&q);
}

static void allgather(void) {
  MPI_Allgather(record, 256, MPI_BYTE, records, 256, MPI_BYTE, MPI_COMM_WORLD);
}

static void bruck(void) {
  memcpy(records, record, 256);
  for (int have = 1, dist = 1; have < size; have += dist < size - have ? dist : size - have,
           dist *= 2) {
    int blocks = dist < size - have ? dist : size - have, flag = 0;
    MPI_Request q[2];
    MPI_Irecv(records + have * 256, blocks * 256, MPI_BYTE, (rank + dist) % size, 9,
              MPI_COMM_WORLD, &q[0]);
    MPI_Isend(records, blocks * 256, MPI_BYTE, (rank + size - dist) % size, 9, MPI_COMM_WORLD,
              &q[1]);
    while (!flag) MPI_Testall(2, q, &flag, MPI_STATUSES_IGNORE);
  }
}

static int by_value(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

#define REPS 7
typedef struct {
  const char *name;
  void (*run)(size_t, int);
  size_t kib;
  int depth;
} Variant;

static void measure(const Variant *v, int n, double unit, const char *units) {
  double t[64][REPS];
  for (int r = 0; r < REPS; r++)
    for (int i = 0; i < n; i++) {
      MPI_Barrier(MPI_COMM_WORLD);
      double t0 = now();
      v[i].run(v[i].kib * KIB / 4, v[i].depth);
      t[i][r] = now() - t0;
    }
  for (int i = 0; rank == 0 && i < n; i++) {
    qsort(t[i], REPS, sizeof(double), by_value);
    printf("%-52s", v[i].name);
    if (v[i].kib) printf(" %4zu KiB x %d", v[i].kib, v[i].depth);
    else printf("            ");
    printf("  %7.2f %s\n", t[i][REPS / 2] * unit, units);
  }
}

int main(int argc, char **argv) {
  int provided;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const char *part = argc > 1 ? argv[1] : "large";
  if (!strcmp(part, "small")) {
    void (*runs[])(void) = {raw_one_float, iallgather, allgather, bruck};
    const char *names[] = {"raw MPI_Allreduce of 1 float", "256 B: MPI_Iallgather, polled",
                           "256 B: MPI_Allgather",
                           "256 B: Bruck over MPI_Isend/MPI_Irecv, polled"};
    for (int i = 0; i < 4; i++) {
      double t[REPS];
      for (int r = 0; r < REPS; r++) {
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = now();
        for (int k = 0; k < 5000; k++) runs[i]();
        t[r] = (now() - t0) / 5000;
      }
      qsort(t, REPS, sizeof(double), by_value);
      if (rank == 0) printf("%-52s  %7.3f us\n", names[i], t[REPS / 2] * 1e6);
    }
    MPI_Finalize();
    return 0;
  }
  FILE *f = fopen("benches/data/resnet50_params.tsv", "r");
  if (!f) {
    fprintf(stderr, "run from the repository root (benches/data/resnet50_params.tsv)\n");
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  char line[512];
  int t = 0;
  while (t < TENSORS && fgets(line, sizeof line, f)) {
    char *last = strrchr(line, '\t');
    if (line[0] == '#' || !last) continue;
    sizes[t] = atoi(last + 1);
    N += sizes[t++];
  }
  fclose(f);
  float **bufs[] = {&src, &dst, &whole_s, &whole_r};
  for (int i = 0; i < 4; i++) {
    *bufs[i] = malloc(N * 4);
    for (size_t k = 0; k < N; k++) (*bufs[i])[k] = (float)(k % 7);
  }
  for (int i = 0; i < 8; i++)
    for (int j = 0; j < 2; j++) st[i][j] = calloc(1, 4 << 20);
  shm_setup();
  pthread_t thread;
  pthread_create(&thread, NULL, helper, NULL);
  Variant v[] = {
      {"one MPI_Allreduce", one_call, 0, 0},
      {"one MPI_Allreduce, MPI_IN_PLACE", one_call_in_place, 0, 0},
      {"161 MPI_Allreduce (one per tensor)", per_tensor, 0, 0},
      {"161 MPI_Allreduce (one per tensor), MPI_IN_PLACE", per_tensor_in_place, 0, 0},
      {"blocking MPI_Allreduce pieces, caller's buffers", blocking_pieces, 512, 1},
      {"blocking MPI_Allreduce pieces, staged", blocking_staged, 512, 1},
      {"the same on a helper thread", on_helper, 512, 1},
      {"whole buffer staged, MPI_Iallreduce pieces", whole_staged, 1024, 4},
      {"MPI_Iallreduce pieces, caller's buffers", caller_buffers, 512, 4},
      {"MPI_Iallreduce pieces, each staged", staged_pieces, 256, 2},
      {"MPI_Iallreduce pieces, each staged", staged_pieces, 512, 2},
      {"MPI_Iallreduce pieces, each staged", staged_pieces, 512, 4},
      {"MPI_Iallreduce pieces, each staged", staged_pieces, 1024, 2},
      {"ring over MPI_Isend/MPI_Irecv, staged, host sum", ring, 512, 1},
      {"the same ring, pieces in flight (the engine's)", ring_pipelined, 512, 2},
      {"pairwise exchange, staged, host sum (2 ranks)", pairwise, 512, 2},
      {"pairwise exchange, staged, host sum (2 ranks)", pairwise, 256, 2},
      {"pairwise exchange, staged, host sum (2 ranks)", pairwise, 512, 4},
      {"pairwise, the send from the caller's buffer", pairwise_unstaged, 512, 2},
      {"pairwise, the send from the caller's buffer", pairwise_unstaged, 1024, 2},
      {"shared-memory window, in place", shm_in_place, 512, 2},
      {"shared-memory window, in place", shm_in_place, 128, 4},
      {"shared-memory window, in place, through stages", shm_staged, 128, 4},
      {"floor: each piece copied to a slot and back", floor_copies, 128, 4},
      {"broadcast: one MPI_Bcast", bcast_blocking, 0, 0},
      {"broadcast: whole buffer staged, one MPI_Ibcast", bcast_whole, 0, 0},
      {"broadcast: MPI_Ibcast pieces, each staged", bcast_pieces, 512, 2},
  };
  if (rank == 0) printf("%zu f32 (%d tensors), %d ranks, medians of %d\n", N, TENSORS, size, REPS);
  measure(v, sizeof v / sizeof v[0], 1e3, "ms");
  MPI_Finalize();
  return 0;
}
