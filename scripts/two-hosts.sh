#!/usr/bin/env bash
# Two simulated hosts on one machine: two network namespaces ("hostA" 10.77.0.1, "hostB"
# 10.77.0.2) joined by a veth pair, and mpirun launching one rank per host through an rsh agent
# that runs `ip netns exec`, so MPI traffic crosses real network stacks (TCP over the veth; no
# shared memory between the hosts). Needs root, iproute2 and Open MPI.
#
#   bash scripts/two-hosts.sh [--delay MS] -- PROGRAM [ARGS...]   one rank of PROGRAM per host
#   bash scripts/two-hosts.sh --self-test                          an MPI allreduce across them
#
# --delay adds MS of latency each way on the link (tc netem), to show what a slow link costs.
# Prints "skipped: ..." and exits 0 where namespaces cannot be made (not root, no iproute2, a
# sandbox without network namespaces); the namespaces are removed on exit.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

delay="" self_test=0
while (($#)); do
  case $1 in
    --delay) delay=$2; shift 2 ;;
    --self-test) self_test=1; shift ;;
    --) shift; break ;;
    *) echo "usage: $0 [--delay MS] -- PROGRAM [ARGS...] | --self-test" >&2; exit 2 ;;
  esac
done
if ((!self_test)) && (($# == 0)); then
  echo "usage: $0 [--delay MS] -- PROGRAM [ARGS...] | --self-test" >&2
  exit 2
fi

skip() { echo "two simulated hosts: skipped: $*"; exit 0; }
[ "$(id -u)" = 0 ] || skip "needs root (ip netns)"
command -v ip >/dev/null 2>&1 || skip "iproute2 (ip) is not installed"
command -v mpirun >/dev/null 2>&1 || skip "mpirun is not installed (Open MPI)"
command -v unshare >/dev/null 2>&1 || skip "unshare (util-linux) is not installed"

# Names unique to this run, so that concurrent runs and leftovers of a killed one do not clash.
tag=$$
nsA=dpsA$tag nsB=dpsB$tag
work=$(mktemp -d)
cleanup() {
  ip netns del "$nsA" 2>/dev/null || true
  ip netns del "$nsB" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
if ! ip netns add "$nsA" 2>/dev/null || ! ip netns add "$nsB" 2>/dev/null; then
  skip "cannot create network namespaces here"
fi
ip link add "vA$tag" type veth peer name "vB$tag" || skip "cannot create a veth pair"
ip link set "vA$tag" netns "$nsA"
ip link set "vB$tag" netns "$nsB"
ip -n "$nsA" addr add 10.77.0.1/24 dev "vA$tag"
ip -n "$nsB" addr add 10.77.0.2/24 dev "vB$tag"
for ns in "$nsA" "$nsB"; do ip -n "$ns" link set lo up; done
ip -n "$nsA" link set "vA$tag" up
ip -n "$nsB" link set "vB$tag" up
if [ -n "$delay" ]; then
  ip netns exec "$nsA" tc qdisc add dev "vA$tag" root netem delay "${delay}ms" &&
    ip netns exec "$nsB" tc qdisc add dev "vB$tag" root netem delay "${delay}ms" ||
    skip "tc netem is not available (kernel module sch_netem)"
fi

# mpirun's rsh agent: "agent [options] HOST COMMAND..." runs COMMAND in HOST's namespace, with
# the host's own name (Open MPI tells nodes apart by hostname).
cat >"$work/agent" <<EOF
#!/bin/sh
while [ "\${1#-}" != "\$1" ]; do shift; done
host=\$1; shift
case \$host in
  10.77.0.1) ns=$nsA name=hostA ;;
  10.77.0.2) ns=$nsB name=hostB ;;
  *) echo "two-hosts agent: unknown host \$host" >&2; exit 1 ;;
esac
exec ip netns exec \$ns unshare --uts sh -c "hostname \$name; \$*"
EOF
chmod +x "$work/agent"
printf '10.77.0.1 slots=1\n10.77.0.2 slots=1\n' >"$work/hosts"

if ((self_test)); then
  command -v mpicc >/dev/null 2>&1 || skip "mpicc is not installed (libopenmpi-dev)"
  cat >"$work/hello.c" <<'EOF'
#include <mpi.h>
#include <stdio.h>
#include <unistd.h>
int main(int argc, char **argv) {
  int rank, size, v, sum = 0;
  char host[256];
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  gethostname(host, sizeof host);
  v = rank + 1;
  MPI_Allreduce(&v, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  printf("rank %d of %d on %s: sum %d\n", rank, size, host, sum);
  MPI_Finalize();
  return 0;
}
EOF
  mpicc -o "$work/hello" "$work/hello.c"
  set -- "$work/hello"
fi

# mpirun itself runs on hostA; rank 1's daemon is started on hostB by the agent and connects back
# over the veth. TCP only, on the veth's subnet.
out=$work/out
ip netns exec "$nsA" unshare --uts sh -c "hostname hostA; exec \"\$@\"" sh \
  mpirun --allow-run-as-root --oversubscribe --bind-to none -n 2 --hostfile "$work/hosts" \
  --mca plm_rsh_agent "$work/agent" --mca btl tcp,self \
  --mca oob_tcp_if_include 10.77.0.0/24 --mca btl_tcp_if_include 10.77.0.0/24 \
  "$@" 2>&1 | tee "$out"
status=${PIPESTATUS[0]}
if ((self_test)); then
  grep -q "rank 0 of 2 on hostA: sum 3" "$out" && grep -q "rank 1 of 2 on hostB: sum 3" "$out" || {
    echo "two simulated hosts: FAIL: expected one rank on each host and the sum 3" >&2
    exit 1
  }
  echo "two simulated hosts: ok (one rank per namespace, allreduce over TCP on the veth)"
fi
exit "$status"
