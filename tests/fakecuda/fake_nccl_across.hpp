// The fake NCCL across processes (fake_nccl.cpp's header says how; included there, inside its
// anonymous namespace): the cliques' shared slots and data files, and one collective's round.

constexpr int kMaxRanks = 512;
// A rank's slot: whether it joined, the last round it posted (with that round's op) and the last
// it finished reading; written by the rank's process only.
struct Slot {
  std::atomic<int> joined, aborted;
  std::atomic<uint64_t> posted, consumed;
  int kind, dtype, arg;
  uint64_t count;
};
struct Shared { Slot slot[kMaxRanks]; };
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared atomics must be lock-free");

int joined_ranks(Clique* q) {
  int n = 0;
  for (int r = 0; r < q->nranks; r++) n += q->shared->slot[r].joined.load();
  return n;
}

// Rank r's data file. A rank's process creates it when the rank joins (before the rank counts
// as joined), and the first round opens every rank's, so a rank destroyed (its file unlinked)
// while another process still reads its last round's data is no problem.
std::string data_path(Clique* q, int r) { return q->path + ".r" + std::to_string(r); }
void create_data_file(Clique* q, int r) {
  q->files[r] = open(data_path(q, r).c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
}
int data_file(Clique* q, int r) {
  for (int x = 0; x < q->nranks; x++)
    if (q->files[x] < 0) q->files[x] = open(data_path(q, x).c_str(), O_RDONLY);
  return q->files[r];
}

// The clique's shared slots (created by whichever process comes first; zeroed by the kernel).
// Under the lock.
std::string share(Clique* q) {
  if (q->nranks > kMaxRanks) return fmt("fake NCCL: %d ranks across processes (at most %d)",
                                        q->nranks, kMaxRanks);
  std::string name;
  for (char ch : q->id) name += std::isalnum((unsigned char)ch) ? ch : '-';
  q->path = "/dev/shm/fake-nccl-" + name;
  int fd = open(q->path.c_str(), O_RDWR | O_CREAT, 0600);
  if (fd < 0 || ftruncate(fd, sizeof(Shared)) != 0)
    return fmt("fake NCCL: cannot make %s: %s", q->path.c_str(), std::strerror(errno));
  void* at = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (at == MAP_FAILED) return fmt("fake NCCL: cannot map %s", q->path.c_str());
  q->shared = static_cast<Shared*>(at);
  q->files.assign(q->nranks, -1);
  for (int r = 0; r < q->nranks; r++)
    if (q->ranks[r]) create_data_file(q, r), q->shared->slot[r].joined.store(1);
  return "";
}

// Rank r's data file, opened for writing (its own) or reading.
bool whole_io(bool write, int fd, void* buf, size_t n) {
  char* p = static_cast<char*>(buf);
  for (size_t done = 0; done < n;) {
    ssize_t k = write ? pwrite(fd, p + done, n - done, done) : pread(fd, p + done, n - done, done);
    if (k <= 0) return false;
    done += size_t(k);
  }
  return true;
}

// Waits until every rank's `field` reaches `round`; "" or why not (a rank aborted). 60 s: a hang.
std::string wait_all(Clique* q, std::atomic<uint64_t> Slot::*field, uint64_t round,
                     const char* what) {
  auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < q->nranks;) {
    Slot& s = q->shared->slot[r];
    if ((s.*field).load(std::memory_order_acquire) >= round) { r++; continue; }
    if (s.aborted.load()) return fmt("fake NCCL: rank %d was aborted or destroyed in its process "
                                     "while rank(s) here waited for it (%s)", r, what);
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(60)) {
      std::fprintf(stderr, "fake NCCL: round %llu waited 60 s for rank %d (%s): a hang in real "
                   "NCCL\n", (unsigned long long)round, r, what);
      std::abort();
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  return "";
}

// One collective across processes: `local` are this process's ranks' ops (all alike).
std::string round_across(Clique* q, uint64_t round, const std::vector<const Op*>& local) {
  const Op& mine = *local[0];
  size_t n = send_bytes(mine, q->nranks);
  if (auto why = wait_all(q, &Slot::consumed, round - 1, "the previous round"); !why.empty())
    return why;
  for (const Op* o : local) {
    Slot& s = q->shared->slot[o->comm->rank];
    s.kind = o->kind, s.dtype = o->dtype, s.arg = o->arg, s.count = o->count;
    bool sends = o->kind != Broadcast || o->arg == o->comm->rank;
    int fd = sends && n ? data_file(q, o->comm->rank) : 0;
    if (fd < 0 || (sends && n && !whole_io(true, fd, const_cast<void*>(o->send), n)))
      return fmt("fake NCCL: rank %d cannot write its data: %s", o->comm->rank, std::strerror(errno));
    s.posted.store(round, std::memory_order_release);
  }
  if (auto why = wait_all(q, &Slot::posted, round, describe(&mine).c_str()); !why.empty())
    return why;
  const Slot& ref = q->shared->slot[0];
  for (int r = 1; r < q->nranks; r++) {
    const Slot& s = q->shared->slot[r];
    if (s.kind != ref.kind || s.count != ref.count || s.dtype != ref.dtype || s.arg != ref.arg) {
      Op a{Kind(s.kind), nullptr, nullptr, nullptr, s.count, s.dtype, s.arg};
      Op b{Kind(ref.kind), nullptr, nullptr, nullptr, ref.count, ref.dtype, ref.arg};
      return fmt("fake NCCL: round %llu across processes differs: rank %d queued %s, rank 0 %s",
                 (unsigned long long)round, r, describe(&a).c_str(), describe(&b).c_str());
    }
  }
  // Every rank's bytes, in rank order: this process's from its buffers, the others' from files.
  std::vector<std::vector<char>> read(q->nranks);
  std::vector<const void*> srcs(q->nranks, nullptr);
  for (const Op* o : local) srcs[o->comm->rank] = o->send;
  for (int r = 0; r < q->nranks && n; r++) {
    bool needed = mine.kind != Broadcast || r == mine.arg;
    if (!needed || srcs[r]) continue;
    read[r].resize(n);
    int fd = data_file(q, r);
    if (fd < 0 || !whole_io(false, fd, read[r].data(), n))
      return fmt("fake NCCL: cannot read rank %d's data: %s", r, std::strerror(errno));
    srcs[r] = read[r].data();
  }
  run(q->nranks, srcs, local);
  for (const Op* o : local) q->shared->slot[o->comm->rank].consumed.store(round);
  return "";
}

// A rank leaves: the others' rounds stop waiting for it; its data file goes.
void leave(Comm* c) {
  Clique* q = c->clique;
  if (!q->shared) return;
  q->shared->slot[c->rank].aborted.store(1);
  unlink(data_path(q, c->rank).c_str());
  if (c->rank == 0) unlink(q->path.c_str());  // mapped by every process that joined
}
