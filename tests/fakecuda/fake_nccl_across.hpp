// The fake NCCL across processes (fake_nccl.cpp's header says how; included there, inside its
// anonymous namespace): the cliques' shared slots and data files, and one collective's round.

constexpr int kMaxRanks = 512;
// A rank's slot: whether it joined (and its process), the last round it posted (with that round's
// op) and the last it finished reading; written by the rank's process only.
struct Slot {
  std::atomic<int> joined, aborted, pid;
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
  q->shared->slot[r].pid.store(int(getpid()));
}

// Whether rank r's process ended without aborting or destroying its rank (killed, crashed): real
// NCCL then fails the others' collectives with ncclRemoteError where its proxy sees the peer's
// connection close, or hangs until they are aborted (ranks sharing a GPU, NVLink, shared
// memory); this fake fails them, or under FAKE_NCCL_QUIET_PEERS=1 hangs (until aborted or shrunk
// with NCCL_SHRINK_ABORT on their own process, or the 60 s abort).
bool process_gone(const Slot& s) {
  static const bool quiet = [] {
    const char* v = std::getenv("FAKE_NCCL_QUIET_PEERS");
    return v && !std::strcmp(v, "1");
  }();
  if (quiet) return false;
  int pid = s.pid.load();
  return pid > 0 && kill(pid, 0) != 0 && errno == ESRCH;
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

// Waits until every rank's `field` reaches `round`; "" or why not. While any rank is behind,
// every rank is looked at: one aborted (this process's own included: ncclCommAbort ends its
// kernels) or whose process is gone ends the wait, wherever it is in the clique (a wait on a
// live rank that is behind must not hide a dead one after it). 60 s: a hang.
std::string wait_all(Clique* q, std::atomic<uint64_t> Slot::*field, uint64_t round,
                     const char* what) {
  auto start = std::chrono::steady_clock::now();
  auto first_behind = [&] {
    for (int r = 0; r < q->nranks; r++)
      if ((q->shared->slot[r].*field).load(std::memory_order_acquire) < round) return r;
    return -1;
  };
  for (;;) {
    int behind = first_behind();
    if (behind < 0) return "";
    for (int r = 0; r < q->nranks; r++) {
      Slot& s = q->shared->slot[r];
      // A rank that ended after every rank reached the round (a context destroyed once its
      // last collective went) ends nothing.
      if ((s.aborted.load() || process_gone(s)) && first_behind() < 0) return "";
      if (s.aborted.load()) return fmt("fake NCCL: rank %d was aborted or destroyed in its process "
                                       "while rank(s) here waited for rank %d (%s)", r, behind, what);
      if (process_gone(s)) return fmt("fake NCCL: rank %d's process is gone (it ended without "
                                      "aborting its rank) while rank(s) here waited for rank %d (%s)",
                                      r, behind, what);
    }
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(60)) {
      std::fprintf(stderr, "fake NCCL: round %llu waited 60 s for rank %d (%s): a hang in real "
                   "NCCL\n", (unsigned long long)round, behind, what);
      std::abort();
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// fake_nccl_die_at_next_round: this process SIGKILLs itself before it posts its next round
// (a rank dead inside a collective the others have queued); fake_nccl_die_after_next_round:
// `die_after_us` µs after its next round is done here (a rank dead between the others' data
// and their vote, or inside the vote).
std::atomic<bool> die_next{false}, die_after{false};
std::atomic<unsigned> die_after_us{0};
void die_if_asked(bool done = false) {
  if (!done && die_next.load()) kill(getpid(), SIGKILL);
  if (done && die_after.exchange(false))
    std::thread([] {
      std::this_thread::sleep_for(std::chrono::microseconds(die_after_us.load()));
      kill(getpid(), SIGKILL);
    }).detach();
}

// One collective across processes: `local` are this process's ranks' ops (all alike).
std::string round_across(Clique* q, uint64_t round, const std::vector<const Op*>& local) {
  die_if_asked();
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
  die_if_asked(true);
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

// Sends and receives across processes (a group with a peer in another process): one round that
// every rank of the clique joins (dpsync's all-to-all gives every process some with another; a
// process's rank with none posts an empty list, and a process that never posts is a hang: the
// 60 s abort; real NCCL needs only the peers, a difference dpsync never meets). Each rank writes its data file: its ops' list (kind, peer,
// count, dtype; a send's data offset) then its sends' data; every process reads every rank's
// list, so all of them find the same mismatch (a send without its recv, a count or dtype that
// differs) and fail the round alike; then each recv copies its send's data.
struct P2pEntry { int32_t kind, peer, dtype, pad; uint64_t count, offset; };

std::string p2p_across(Clique* q, uint64_t round, const std::vector<const Op*>& ops) {
  die_if_asked();
  int n = q->nranks;
  if (auto why = wait_all(q, &Slot::consumed, round - 1, "the previous round"); !why.empty())
    return why;
  for (int r = 0; r < n; r++) {
    Comm* c = q->ranks[r];
    if (!c || c->dead) continue;
    std::vector<P2pEntry> list;
    std::vector<char> data;
    for (const Op* o : ops) {
      if (o->comm != c) continue;
      list.push_back({o->kind, o->arg, o->dtype, 0, o->count, data.size()});
      if (o->kind == Send) {
        const char* from = static_cast<const char*>(o->send);
        data.insert(data.end(), from, from + bytes(*o));
      }
    }
    uint64_t head = list.size();
    std::vector<char> blob(sizeof head + list.size() * sizeof(P2pEntry));
    std::memcpy(blob.data(), &head, sizeof head);
    if (!list.empty()) std::memcpy(blob.data() + sizeof head, list.data(), list.size() * sizeof(P2pEntry));
    blob.insert(blob.end(), data.begin(), data.end());
    Slot& s = q->shared->slot[r];
    s.kind = Send, s.dtype = 0, s.arg = 0, s.count = blob.size();
    int fd = data_file(q, r);
    if (fd < 0 || !whole_io(true, fd, blob.data(), blob.size()))
      return fmt("fake NCCL: rank %d cannot write its data: %s", r, std::strerror(errno));
    s.posted.store(round, std::memory_order_release);
  }
  if (auto why = wait_all(q, &Slot::posted, round, "sends and recvs"); !why.empty()) return why;
  std::vector<std::vector<char>> blobs(n);
  std::vector<std::vector<P2pEntry>> lists(n);
  for (int r = 0; r < n; r++) {
    const Slot& s = q->shared->slot[r];
    if (s.kind != Send) {
      Op a{Kind(s.kind), nullptr, nullptr, nullptr, s.count, s.dtype, s.arg};
      return fmt("fake NCCL: round %llu across processes differs: rank %d queued %s, other ranks "
                 "sends and recvs", (unsigned long long)round, r, describe(&a).c_str());
    }
    blobs[r].resize(s.count);
    int fd = data_file(q, r);
    if (fd < 0 || !whole_io(false, fd, blobs[r].data(), s.count))
      return fmt("fake NCCL: cannot read rank %d's data: %s", r, std::strerror(errno));
    uint64_t head;
    std::memcpy(&head, blobs[r].data(), sizeof head);
    lists[r].resize(head);
    if (head) std::memcpy(lists[r].data(), blobs[r].data() + sizeof head, head * sizeof(P2pEntry));
  }
  // Every link's sends (at a) and recvs (at b), in issue order: the same check on every process.
  std::map<std::pair<int, int>, std::vector<const P2pEntry*>> sends, recvs;
  for (int r = 0; r < n; r++)
    for (const P2pEntry& e : lists[r]) {
      if (e.kind == Send) sends[{r, e.peer}].push_back(&e);
      else recvs[{e.peer, r}].push_back(&e);
    }
  std::set<std::pair<int, int>> links;
  for (auto& [link, _] : sends) links.insert(link);
  for (auto& [link, _] : recvs) links.insert(link);
  for (auto [a, b] : links) {
    auto &s = sends[{a, b}], &r = recvs[{a, b}];
    if (s.size() != r.size())
      return fmt("fake NCCL: rank %d queued %zu send(s) to rank %d, but rank %d queued %zu "
                 "recv(s) from rank %d (across processes)", a, s.size(), b, b, r.size(), a);
    for (size_t k = 0; k < s.size(); k++)
      if (s[k]->count != r[k]->count || s[k]->dtype != r[k]->dtype)
        return fmt("fake NCCL: send #%zu from rank %d to rank %d is %llu %s, the recv it pairs "
                   "with %llu %s (across processes)", k, a, b, (unsigned long long)s[k]->count,
                   type_name[s[k]->dtype], (unsigned long long)r[k]->count, type_name[r[k]->dtype]);
  }
  // This process's recvs, in issue order per link: the k-th recv takes the k-th send's data.
  std::map<std::pair<int, int>, size_t> taken;
  for (const Op* o : ops) {
    count_sent(*o, 2);
    if (o->kind != Recv) continue;
    int a = o->arg, b = o->comm->rank;
    const P2pEntry* e = sends[{a, b}][taken[{a, b}]++];
    const char* from = blobs[a].data() + sizeof(uint64_t) + lists[a].size() * sizeof(P2pEntry);
    std::memcpy(o->recv, from + e->offset, bytes(*o));
  }
  for (int r = 0; r < n; r++)
    if (q->ranks[r] && !q->ranks[r]->dead) q->shared->slot[r].consumed.store(round);
  die_if_asked(true);
  return "";
}
