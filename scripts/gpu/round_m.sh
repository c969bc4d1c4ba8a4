#!/usr/bin/env bash
# What holds staged loads (SubmitScatter) near 72% of the H2D link
# (TestStagedLoadProbe). Binaries: build/gpuJ (bench.test).
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT/m"; R=$OUT/m
export KVO_REQUIRE_GPU=1 KVO_BENCH_OUT=$R
(cd bench && KVO_BENCH_PARBATCH=1 timeout 300 ../build/gpuJ/bench.test -test.run 'TestStagedLoadProbe$' -test.v -test.timeout 6m > "$R/staged.log" 2>&1); echo "staged rc=$?"
grep -E '^(Link|\| |--- FAIL|panic)|Error' "$R/staged.log" | cut -c1-300
