#!/usr/bin/env bash
# The main demo: builds libdpsync and the C examples, then trains a small model data-parallel
# on 4 host replicas and checks it ends with the same weights as on 1 replica.
source "$(dirname "$0")/common.sh"
ensure_tools
build_library
build_examples
step "train_dense on 1 host replica (reference)"
build/examples/train_dense --replicas 1 --save build/examples/weights_1.bin | tail -n 3
step "train_dense on 4 host replicas, compared with the reference"
build/examples/train_dense --replicas 4 --expect build/examples/weights_1.bin --tol 1e-5
step "bmuf_train: local SGD on 4 host replicas merged by BMUF every 8 steps, beside synchronous SGD"
build/examples/bmuf_train --replicas 4 --local-steps 8
