#!/usr/bin/env bash
# TestStagedLoadProbe again with CUDA_DEVICE_MAX_CONNECTIONS=32 (each stream
# its own hardware queue: no false dependencies between the DMA stream and the
# scatter stream), then the block benchmark the same way. Binaries: build/gpuJ.
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT/n"; R=$OUT/n
export KVO_REQUIRE_GPU=1 KVO_BENCH_OUT=$R CUDA_DEVICE_MAX_CONNECTIONS=32
(cd bench && KVO_BENCH_PARBATCH=1 timeout 300 ../build/gpuJ/bench.test -test.run 'TestStagedLoadProbe$' -test.v -test.timeout 6m > "$R/staged.log" 2>&1); echo "staged rc=$?"
(cd bench && KVO_BENCH_BLOCKS=1 timeout 300 ../build/gpuJ/bench.test -test.run 'TestBlocksBench$' -test.v -test.timeout 6m > "$R/blocks.log" 2>&1); echo "blocks rc=$?"
grep -E '^(Link|\| |--- FAIL|panic)|Error' "$R/staged.log" | cut -c1-300
grep -E '^(\| |--- FAIL|panic)|Error' "$R/blocks.log" | cut -c1-300
