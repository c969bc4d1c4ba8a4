#!/usr/bin/env bash
# After the staged path uploads every chunk's descriptors up front:
# TestStagedLoadProbe, the block benchmark, and cudacopy's GPU tests (byte-exact
# staged round trips). Binaries: build/gpuJ (bench.test, transfer_cudacopy.test).
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT/o"; R=$OUT/o
export KVO_REQUIRE_GPU=1 KVO_BENCH_OUT=$R
(cd transfer/cudacopy && timeout 200 ../../build/gpuJ/transfer_cudacopy.test -test.run GPU -test.v -test.timeout 3m > "$R/gpu-cudacopy.log" 2>&1); echo "cudacopy tests rc=$?"
(cd bench && KVO_BENCH_PARBATCH=1 timeout 300 ../build/gpuJ/bench.test -test.run 'TestStagedLoadProbe$' -test.v -test.timeout 6m > "$R/staged.log" 2>&1); echo "staged rc=$?"
(cd bench && KVO_BENCH_BLOCKS=1 timeout 300 ../build/gpuJ/bench.test -test.run 'TestBlocksBench$' -test.v -test.timeout 6m > "$R/blocks.log" 2>&1); echo "blocks rc=$?"
grep -E '^(--- |ok|FAIL|panic)' "$R/gpu-cudacopy.log" | sort | uniq -c
grep -E '^(Link|\| |--- FAIL|panic)|Error' "$R/staged.log" | cut -c1-300
grep -E '^(\| |--- FAIL|panic)|Error' "$R/blocks.log" | cut -c1-300
