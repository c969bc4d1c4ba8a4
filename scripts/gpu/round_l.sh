#!/usr/bin/env bash
# Bounds of a CPU-staged path for both directions at once (TestMixedBound):
# one side's scattered segments by the default kernel launch beside the other
# side's 2 GiB moved contiguously by the copy engine, and the rate of a CPU
# gather of scattered host segments from 1-12 threads. Binaries: build/gpuJ.
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT/l"; R=$OUT/l
export KVO_REQUIRE_GPU=1 KVO_BENCH_OUT=$R
(cd bench && KVO_BENCH_PARBATCH=1 timeout 300 ../build/gpuJ/bench.test -test.run 'TestMixedBound$' -test.v -test.timeout 6m > "$R/mixed.log" 2>&1); echo "mixed rc=$?"
grep -E '^(Link|\| |--- FAIL|panic|CPU)' "$R/mixed.log" | cut -c1-400
