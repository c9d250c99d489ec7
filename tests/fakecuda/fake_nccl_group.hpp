// The fake NCCL's groups (included by fake_nccl.cpp inside its anonymous namespace): matching
// every rank's ops of a clique, running them (at once, or on their streams under
// FAKE_CUDA_ASYNC=1), and the calling thread's group.

// One clique's ops of a group: collectives by rank in order; sends and recvs by (from, to).
struct Plan {
  Clique* clique = nullptr;
  uint64_t first_round = 0;  // across processes: the round of the first collective
  std::vector<std::vector<const Op*>> coll;
  std::map<std::pair<int, int>, std::vector<const Op*>> sends, recvs;
  // Across processes: this process's sends and recvs in issue order, matched in their round.
  std::vector<const Op*> p2p;
};

// What disagrees, or "" when every rank's ops pair up.
std::string match(Clique* q, const std::vector<const Op*>& ops, Plan& p) {
  int n = q->nranks;
  int joined = q->shared ? joined_ranks(q)
                         : n - int(std::count(q->ranks.begin(), q->ranks.end(), nullptr));
  if (joined < n)
    return fmt("fake NCCL: only %d of the %d ranks of the communicator were initialised", joined, n);
  p.clique = q;
  p.coll.assign(n, {});
  // Sends and recvs with a peer in another process make the group's p2p a round across the
  // processes (p2p_across); those among this process's ranks alone run here, as in one process.
  bool remote = false;
  for (const Op* o : ops) remote |= q->shared && o->kind >= Send && !q->ranks[o->arg];
  for (const Op* o : ops) {
    int r = o->comm->rank;
    if (remote && o->kind >= Send) p.p2p.push_back(o);
    else if (o->kind == Send) p.sends[{r, o->arg}].push_back(o);
    else if (o->kind == Recv) p.recvs[{o->arg, r}].push_back(o);
    else p.coll[r].push_back(o);
  }
  size_t most = 0;
  for (auto& v : p.coll) most = std::max(most, v.size());
  for (size_t i = 0; i < most; i++) {
    const Op* ref = nullptr;  // the lowest rank's i-th collective is the one the others must match
    for (auto& v : p.coll)
      if (!ref && i < v.size()) ref = v[i];
    int rr = ref->comm->rank;
    for (int r = 0; r < n; r++) {
      if (!q->ranks[r]) continue;  // another process's: matched in the round (shared memory)
      if (i >= p.coll[r].size())
        return fmt("fake NCCL: rank %d of %d queued no %s to pair with rank %d's (count %zu)%s", r, n,
                   kind_name[ref->kind], rr, ref->count,
                   q->ranks[r]->dead ? "; it was destroyed or aborted" : "");
      const Op* o = p.coll[r][i];
      if (o->kind != ref->kind || o->count != ref->count || o->dtype != ref->dtype ||
          o->arg != ref->arg)
        return fmt("fake NCCL: collective #%zu of the group differs: rank %d of %d queued %s, "
                   "rank %d %s", i, r, n, describe(o).c_str(), rr, describe(ref).c_str());
    }
  }
  std::set<std::pair<int, int>> links;
  for (auto& [link, _] : p.sends) links.insert(link);
  for (auto& [link, _] : p.recvs) links.insert(link);
  for (auto [a, b] : links) {
    auto &s = p.sends[{a, b}], &r = p.recvs[{a, b}];
    if (s.size() != r.size())
      return fmt("fake NCCL: rank %d queued %zu send(s) to rank %d, but rank %d queued %zu "
                 "recv(s) from rank %d", a, s.size(), b, b, r.size(), a);
    for (size_t k = 0; k < s.size(); k++)
      if (s[k]->count != r[k]->count || s[k]->dtype != r[k]->dtype)
        return fmt("fake NCCL: send #%zu from rank %d to rank %d is %zu %s, the recv it pairs "
                   "with %zu %s", k, a, b, s[k]->count, type_name[s[k]->dtype], r[k]->count,
                   type_name[r[k]->dtype]);
  }
  // Sends and recvs of a group run concurrently on a GPU: a recv buffer shared with another
  // p2p buffer of the group is a data race there, whatever order this fake would pick.
  for (const Op* o : ops) {
    if (o->kind != Recv || !o->count) continue;
    for (const Op* x : ops) {
      const char* xb = static_cast<const char*>(x->kind == Send ? x->send : x->recv);
      const char* ob = static_cast<const char*>(o->recv);
      if (x == o || x->kind < Send || !x->count) continue;
      if (xb >= ob + bytes(*o) || ob >= xb + bytes(*x)) continue;
      return fmt("fake NCCL: rank %d's recv buffer (from rank %d) overlaps rank %d's %s buffer "
                 "(%s rank %d) in the same group: a data race on a GPU", o->comm->rank, o->arg,
                 x->comm->rank, kind_name[x->kind], x->kind == Send ? "to" : "from", x->arg);
    }
  }
  return "";
}

// Runs a matched plan: "" or why it failed (a round across processes).
std::string execute(const Plan& p) {
  Clique* q = p.clique;
  if (q->shared) {
    size_t rounds = 0;
    for (auto& v : p.coll) rounds = std::max(rounds, v.size());
    for (size_t i = 0; i < rounds; i++) {
      std::vector<const Op*> local;
      for (auto& v : p.coll)
        if (!v.empty()) local.push_back(v[i]);
      if (auto why = round_across(q, p.first_round + i, local); !why.empty()) return why;
    }
    if (!p.p2p.empty()) return p2p_across(q, p.first_round + rounds, p.p2p);
  } else {
    for (size_t i = 0; i < p.coll[0].size(); i++) {
      std::vector<const Op*> rk;
      std::vector<const void*> srcs;
      for (auto& v : p.coll) rk.push_back(v[i]), srcs.push_back(v[i]->send);
      run(int(rk.size()), srcs, rk);
    }
  }
  std::vector<std::pair<void*, std::vector<char>>> moves;  // every send is read before any recv
  for (auto& [link, s] : p.sends)
    for (size_t k = 0; k < s.size(); k++) {
      count_sent(*s[k], 2), count_sent(*p.recvs.at(link)[k], 2);
      const char* from = static_cast<const char*>(s[k]->send);
      moves.emplace_back(p.recvs.at(link)[k]->recv, std::vector<char>(from, from + bytes(*s[k])));
    }
  for (auto& [to, data] : moves)
    if (!data.empty()) std::memcpy(to, data.data(), data.size());
  return "";
}

// A failed round: every communicator of the clique here says why (under the lock).
void fail_clique(Clique* q, const std::string& why) {
  bool remote = why.find("aborted or destroyed") != std::string::npos ||
                why.find("process is gone") != std::string::npos;
  int code = remote ? RemoteError : InvalidUsage;
  for (Comm* c : q->ranks)
    if (c && !c->dead && c->error == Success) c->error = code, c->last = why;
  last_global = why;
}

// The rounds of a matched plan across processes, numbered in issue order (under the lock).
void number_rounds(Plan& p) {
  size_t rounds = 0;
  for (auto& v : p.coll) rounds = std::max(rounds, v.size());
  p.first_round = p.clique->rounds + 1;
  p.clique->rounds += rounds + (p.p2p.empty() ? 0 : 1);  // the sends and recvs: one round
}

// Under FAKE_CUDA_ASYNC: one clique's ops of a group, queued on every stream they name and run
// once all those streams reached them (as NCCL's kernels wait for their peers), by the last
// stream to arrive; the others wait until it is done. A stream that waits 60 s is a deadlock on
// a GPU too (say, one rank's stream waits for an event recorded after its peer's collective).
struct Launch {
  std::vector<Op> ops;  // fixed before `plan` points into it
  Plan plan;
  std::mutex m;
  std::condition_variable cv;
  size_t streams = 0, arrived = 0, left = 0;
  bool done = false;
};

void arrive(void* arg) {
  auto* l = static_cast<Launch*>(arg);
  std::unique_lock<std::mutex> g(l->m);
  if (++l->arrived == l->streams) {
    g.unlock();
    if (auto why = execute(l->plan); !why.empty()) {
      std::lock_guard<std::mutex> guard(mu);
      fail_clique(l->plan.clique, why);
    }
    g.lock();
    l->done = true;
    l->cv.notify_all();
  } else if (!l->cv.wait_for(g, std::chrono::seconds(60), [&] { return l->done; })) {
    std::fprintf(stderr, "fake NCCL: a %s of the group waited 60 s for the other ranks' streams "
                 "(%zu of %zu arrived): the ranks' streams wait for each other, a deadlock on a "
                 "GPU too\n", kind_name[l->ops[0].kind], l->arrived, l->streams);
    std::abort();
  }
  bool last = ++l->left == l->streams;
  g.unlock();
  if (last) delete l;
}

void launch_on_streams(Clique* q, const std::vector<const Op*>& ops, const Cuda* cu,
                       uint64_t first_round) {
  auto* l = new Launch;
  for (const Op* o : ops) l->ops.push_back(*o);
  std::vector<const Op*> mine;
  for (const Op& o : l->ops) mine.push_back(&o);
  match(q, mine, l->plan);  // matched before: cannot fail now
  l->plan.first_round = first_round;
  std::vector<std::pair<void*, int>> streams;  // (stream, device of a default stream)
  for (const Op& o : l->ops) {
    std::pair<void*, int> at{o.stream, o.comm->device};
    if (std::find(streams.begin(), streams.end(), at) == streams.end()) streams.push_back(at);
  }
  l->streams = streams.size();
  for (auto [stream, device] : streams) cu->enqueue(stream, device, arrive, l);
}

// Runs the calling thread's group (the outermost ncclGroupEnd, or one call outside a group).
int run_group() {
  Group g = std::move(group);
  group = Group{};
  std::vector<Clique*> order;
  auto add = [&](Clique* q) {
    if (std::find(order.begin(), order.end(), q) == order.end()) order.push_back(q);
  };
  for (const Op& o : g.ops) add(live(o.comm)->clique);  // destroyed since queued: abort
  for (auto& [q, _] : g.broken) add(q);
  int rc = g.code;
  for (Clique* q : order) {
    std::vector<const Op*> ops;
    for (const Op& o : g.ops)
      if (o.comm->clique == q) ops.push_back(&o);
    Plan p;
    std::string why = g.broken.count(q) ? g.broken[q] : match(q, ops, p);
    if (!why.empty()) {
      // None of the clique's ops run and all its comms say why (real NCCL would hang).
      for (Comm* c : q->ranks)
        if (c && !c->dead && c->error == Success) c->error = InvalidUsage, c->last = why;
      last_global = why;
      rc = InvalidUsage;
      continue;
    }
    const char* env = std::getenv("FAKE_NCCL_FAULT");
    std::string fault = env ? env : "";
    if (fault == "error") {
      for (const Op* o : ops)
        o->comm->error = SystemError, o->comm->last = "fake NCCL: injected failure";
      continue;
    }
    if (!fault.empty() && fault != "hang") {
      std::fprintf(stderr, "fake NCCL: FAKE_NCCL_FAULT=%s: expected hang or error\n", env);
      std::abort();
    }
    if (q->shared) number_rounds(p);
    const Cuda* cu = ops.empty() ? nullptr : cuda(ops[0]->comm);
    if (cu && cu->async()) launch_on_streams(q, ops, cu, p.first_round);
    else if (auto why = execute(p); !why.empty()) fail_clique(q, why), rc = InvalidUsage;
    if (fault == "hang")
      for (const Op* o : ops) o->comm->hang = true;
    for (const Op* o : ops)
      if (!o->comm->connected) o->comm->connected = true, setup_delay(o->comm);
  }
  // A clique still missing ranks when its init group ends spans processes.
  for (Comm* c : g.touched) {
    Clique* q = c->clique;
    if (c->dead || q->shared || !std::count(q->ranks.begin(), q->ranks.end(), nullptr)) continue;
    if (auto why = share(q); !why.empty()) {
      fail_clique(q, why);
      rc = SystemError;
    }
  }
  bool nonblocking = false;
  for (Comm* c : g.touched) {
    if (c->dead) continue;
    if (!c->blocking) {
      nonblocking = true;
      c->pending = c->error == Success;  // so the caller's polling loop runs at least once
    } else if (rc == Success) {
      rc = c->error;  // a blocking comm reports at once
    }
  }
  return rc == Success && nonblocking ? InProgress : rc;
}
