// The fake NCCL's ncclCommShrink (NCCL 2.27+; included by fake_nccl.cpp inside its anonymous
// namespace, after init and finish).

// The survivors' child of a clique: rank r becomes r less the excluded ranks below it. Its
// unique id is the parent's with the excluded list appended, so every survivor's process finds
// the same child (a survivor with another list joins another one: its init never completes, a
// hang in real NCCL too). NCCL_SHRINK_ABORT (1) first ends the parent's ops (stuck or waiting on
// a dead peer, on every process: the rank's slot reads aborted); without it a parent in error is
// refused. An excluded rank does not call it (refused here).
int shrink(void* comm, int* exclude, int count, void** newcomm, const ConfigHead* config, int flags) {
  std::lock_guard<std::mutex> guard(mu);
  if (!comm || !newcomm || count < 0 || (count > 0 && !exclude))
    return finish(fail(nullptr, InvalidArgument, "fake NCCL: ncclCommShrink: null argument or "
                                                 "negative count"));
  Comm* c = live(comm);
  Clique* q = c->clique;
  int n = q->nranks;
  if (flags != 0 && flags != 1)
    return finish(fail(c, InvalidArgument, fmt("fake NCCL: ncclCommShrink: flags %d (expected "
                                               "NCCL_SHRINK_DEFAULT 0 or NCCL_SHRINK_ABORT 1)", flags)));
  if (config && config->magic != 0xcafebeef)
    return finish(fail(c, InvalidArgument, "fake NCCL: ncclCommShrink: the ncclConfig_t was not "
                                           "made with NCCL_CONFIG_INITIALIZER"));
  std::vector<int> out(exclude, exclude + count);
  std::sort(out.begin(), out.end());
  std::string list;
  for (size_t k = 0; k < out.size(); k++) {
    if (out[k] < 0 || out[k] >= n || (k && out[k] == out[k - 1]))
      return finish(fail(c, InvalidArgument, fmt("fake NCCL: ncclCommShrink of rank %d: excluded "
                                                 "rank %d is out of range or listed twice (of %d)",
                                                 c->rank, out[k], n)));
    if (out[k] == c->rank)
      return finish(fail(c, InvalidArgument, fmt("fake NCCL: ncclCommShrink: rank %d excludes "
                                                 "itself (an excluded rank does not call it)",
                                                 c->rank)));
    list += fmt("%s%d", k ? "," : "", out[k]);
  }
  if (count >= n)
    return finish(fail(c, InvalidArgument, "fake NCCL: ncclCommShrink excludes every rank"));
  if (flags == 0 && (c->error != Success || c->hang))
    return finish(fail(c, InvalidUsage, fmt("fake NCCL: ncclCommShrink of rank %d, failed or stuck, "
                                            "without NCCL_SHRINK_ABORT", c->rank)));
  if (flags == 1) {
    c->shrunk_abort = true, c->hang = false;
    if (q->shared) q->shared->slot[c->rank].aborted.store(1);
  }
  ncclUniqueId child{};
  int len = std::snprintf(child.internal, sizeof child.internal, "%s/x%s", q->id.c_str(), list.c_str());
  if (len < 0 || len >= int(sizeof child.internal))
    return finish(fail(c, InternalError, "fake NCCL: ncclCommShrink: the child's id is too long "
                                         "(too many shrinks in a row)"));
  std::string key(child.internal, sizeof child.internal);
  if (!cliques.count(key)) cliques[key] = new Clique, cliques[key]->id = child.internal;
  int below = int(std::lower_bound(out.begin(), out.end(), c->rank) - out.begin());
  bool blocking = config ? config->blocking != 0 : c->blocking;
  return finish(init(newcomm, n - count, child, c->rank - below, blocking, c->device));
}
