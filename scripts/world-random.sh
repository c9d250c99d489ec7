#!/usr/bin/env bash
# The randomized cross-rank test (tests/world_random.rs) with as many seeds and calls as wanted:
#
#   bash scripts/world-random.sh [--seeds N | --seeds A..B] [--calls N] [--ranks 2,3]
#                                [--no CLASS,...] [--timeout-ms MS] [--limit S] [--trace]
#                                [--kills N | --kills A..B]
#
# --seeds: N seeds from 0, or A..B (inclusive); --calls: calls per seed; --ranks: one mpirun
# per entry (2: replicas 1,2; 3: replicas 3,1,2); --no: classes switched off (the test's
# CLASSES, e.g. boundary,sparse_uneven,sparse_share); --timeout-ms: the contexts' timeout (a
# hang fails after it); --limit: seconds per mpirun (default from seeds x calls); --trace:
# rank 0 prints every call; --kills: the kill variant instead (DPSYNC_RANDOM_KILL_SEEDS: an
# elastic world where one rank SIGKILLs itself at a call drawn from the seed, one mpirun per
# seed, under Open MPI 5 with ULFM: DPSYNC_ULFM, else scripts/common.sh ensure_ulfm installs it).
# DPSYNC_MPI_SHM=0 in the environment: no shared memory between the ranks. Builds with
# --features mpi into target/mpi (DPSYNC_RANDOM_TARGET overrides). A failure prints its seed and
# the command line that replays it.
source "$(dirname "$0")/common.sh"

seeds="" calls="" ranks=2,3 no="" timeout_ms="" limit="" trace="" kills=""
while (($#)); do
  case $1 in
    --seeds) seeds=$2; shift 2 ;;
    --calls) calls=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    --no) no=$2; shift 2 ;;
    --timeout-ms) timeout_ms=$2; shift 2 ;;
    --limit) limit=$2; shift 2 ;;
    --trace) trace=1; shift ;;
    --kills) kills=$2; shift 2 ;;
    -h | --help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "world-random.sh: unknown argument '$1' (--help)" >&2; exit 2 ;;
  esac
done

if [ -z "$limit" ]; then
  # About 0.2 ms a call here (3 ranks on 2 cores); generous, so that only a hang trips it.
  count=${seeds:-50}
  [ -n "$kills" ] && count=1 # per mpirun: one seed each
  [[ $count == *..* ]] && count=$((${count#*..} - ${count%..*} + 1))
  limit=$((120 + count * ${calls:-800} / 100))
fi

ensure_mpi
if [ -n "$kills" ]; then
  [ -n "${DPSYNC_ULFM:-}" ] || ensure_ulfm
  export DPSYNC_RANDOM_KILL_SEEDS=$kills DPSYNC_RANDOM_CALLS=$calls DPSYNC_RANDOM_RANKS=$ranks \
    DPSYNC_RANDOM_NO=$no DPSYNC_RANDOM_TIMEOUT_MS=$timeout_ms DPSYNC_RANDOM_LIMIT_S=$limit \
    DPSYNC_RANDOM_TRACE=$trace
  step "tests/world_random.rs, the kill variant: seeds $kills, calls ${calls:-default}, ranks $ranks, off: ${no:-nothing}, shared memory ${DPSYNC_MPI_SHM:-on}"
  exec cargo test --release --features mpi --target-dir "${DPSYNC_RANDOM_TARGET:-target/mpi}" \
    --test world_random random_kills_across_ranks
fi
export DPSYNC_RANDOM_SEEDS=$seeds DPSYNC_RANDOM_CALLS=$calls DPSYNC_RANDOM_RANKS=$ranks \
  DPSYNC_RANDOM_NO=$no DPSYNC_RANDOM_TIMEOUT_MS=$timeout_ms DPSYNC_RANDOM_LIMIT_S=$limit \
  DPSYNC_RANDOM_TRACE=$trace
step "tests/world_random.rs: seeds ${seeds:-default}, calls ${calls:-default}, ranks $ranks, off: ${no:-nothing}"
cargo test --release --features mpi --target-dir "${DPSYNC_RANDOM_TARGET:-target/mpi}" \
  --test world_random
