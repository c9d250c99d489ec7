# CTest driver for world_train's --reproducible (CMakeLists.txt): trains the demo model with the
# same world replicas arranged over the ranks in several ways, saves each run's final weights and
# compares the files byte for byte.
#
#   cmake -DWORLD_TRAIN=<world_train> -DMPIRUN="<mpiexec> <flags>" -DOUT=<prefix>
#         -DARRANGEMENTS="4 2,2 1,1,1,1 2,1,1" -DARGS="--steps 60 --batch 48"
#         -DMODE=reproducible|plain -P world_repro.cmake
#
# MPIRUN, ARRANGEMENTS and ARGS are space-separated (a ;-list does not survive add_test).
#
# An arrangement is a --replicas-per-rank list: one rank runs world_train directly (no MPIRUN
# needed), several run under MPIRUN -n <ranks>. Every run must exit 0 (its own checks: replicas
# equal within each rank, loss falls, ARGS' --expect if given) and print describe JSON with
# "reproducible" set as MODE says.
#   MODE=reproducible  runs with --reproducible; every weight file must equal the first.
#   MODE=plain         runs without it; at least one weight file must differ from the first
#                      (the summation order follows the arrangement; two arrangements are needed).
# A library without MPI makes world_train print "world_train: skipped:" and exit 77; the driver
# stops there and the test's SKIP_REGULAR_EXPRESSION reports it as skipped.
cmake_minimum_required(VERSION 3.16)

foreach(var WORLD_TRAIN OUT ARRANGEMENTS MODE)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "world_repro.cmake: -D${var}=... is required")
  endif()
endforeach()
if(MODE STREQUAL "reproducible")
  set(flag --reproducible)
  set(describe_value true)
elseif(MODE STREQUAL "plain")
  set(flag "")
  set(describe_value false)
else()
  message(FATAL_ERROR "world_repro.cmake: MODE is '${MODE}', not reproducible or plain")
endif()
foreach(var MPIRUN ARRANGEMENTS ARGS)
  separate_arguments(${var} UNIX_COMMAND "${${var}}")
endforeach()
list(LENGTH ARRANGEMENTS n_arrangements)
if(MODE STREQUAL "plain" AND n_arrangements LESS 2)
  message(FATAL_ERROR "world_repro.cmake: MODE=plain needs two arrangements or more")
endif()

set(files "")
foreach(counts IN LISTS ARRANGEMENTS)
  string(REPLACE "," ";" count_list "${counts}")
  list(LENGTH count_list ranks)
  string(REPLACE "," "-" tag "${counts}")
  set(file "${OUT}_${MODE}_${tag}.bin")
  file(REMOVE "${file}")
  set(cmd "${WORLD_TRAIN}" --replicas-per-rank ${counts} ${ARGS} ${flag}
          --describe --save "${file}")
  if(ranks GREATER 1)
    if(NOT DEFINED MPIRUN OR "${MPIRUN}" STREQUAL "")
      message(FATAL_ERROR
              "world_repro.cmake: arrangement ${counts} has ${ranks} ranks and no -DMPIRUN")
    endif()
    set(cmd ${MPIRUN} -n ${ranks} ${cmd})
  endif()
  list(JOIN cmd " " shown)
  message("-- ${counts} (${ranks} rank(s)): ${shown}")
  execute_process(COMMAND ${cmd} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(out MATCHES "world_train: skipped:")
    message("${out}")
    return()
  endif()
  # The summary lines only: the step lines are many.
  string(REGEX MATCHALL "(saved |final \\(rank)[^\n]*" summary "${out}")
  list(JOIN summary "\n" summary)
  message("${summary}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "world_train --replicas-per-rank ${counts} failed (${rc}):\n${out}\n${err}")
  endif()
  if(NOT out MATCHES "\"reproducible\":${describe_value}[,}]")
    message(FATAL_ERROR "the describe JSON of --replicas-per-rank ${counts} does not say "
                        "\"reproducible\":${describe_value}:\n${out}")
  endif()
  if(NOT EXISTS "${file}")
    message(FATAL_ERROR "world_train --replicas-per-rank ${counts} wrote no ${file}")
  endif()
  list(APPEND files "${file}")
endforeach()

# Byte for byte against the first arrangement's weights.
list(GET ARRANGEMENTS 0 first_counts)
list(GET files 0 first)
set(same "")
set(differ "")
math(EXPR last "${n_arrangements} - 1")
set(others "")
if(last GREATER 0) # foreach(RANGE 1 0) would count down
  foreach(i RANGE 1 ${last})
    list(APPEND others ${i})
  endforeach()
endif()
foreach(i IN LISTS others)
  list(GET ARRANGEMENTS ${i} counts)
  list(GET files ${i} file)
  execute_process(COMMAND "${CMAKE_COMMAND}" -E compare_files "${first}" "${file}"
                  RESULT_VARIABLE cmp)
  if(cmp EQUAL 0)
    list(APPEND same "${counts}")
  else()
    list(APPEND differ "${counts}")
  endif()
endforeach()
list(JOIN same " " same)
list(JOIN differ " " differ)
if(MODE STREQUAL "reproducible")
  if(NOT differ STREQUAL "")
    message(FATAL_ERROR "FAIL: with --reproducible the final weights of ${differ} differ from "
                        "those of ${first_counts}")
  endif()
  if(same STREQUAL "")
    message("reproducible: one arrangement (${first_counts}), nothing to compare it with")
  else()
    message("reproducible: the final weights of ${first_counts} ${same} are byte-identical")
  endif()
else()
  if(differ STREQUAL "")
    message(FATAL_ERROR "FAIL: without --reproducible the final weights of every arrangement "
                        "(${first_counts} ${same}) are byte-identical: these ARGS do not show "
                        "what --reproducible is for")
  endif()
  if(NOT same STREQUAL "")
    set(same " (${same}: identical to it)")
  endif()
  message("plain: the final weights of ${differ} differ from those of ${first_counts}${same}")
endif()
