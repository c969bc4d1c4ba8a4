#!/usr/bin/env bash
# Both directions at once on kernel launches (KVO_BENCH_VARIANTS=bidir, 2 GiB
# per run, the embedded PTX): the D2H read-back interval and grid against the
# H2D grid, with each direction's own rate inside a run of both.
# Binaries: build/gpuJ (bench.test).
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT/j"; R=$OUT/j
export KVO_REQUIRE_GPU=1 KVO_BENCH_OUT=$R
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader > "$R/info.txt" 2>&1
(cd bench && KVO_BENCH_VARIANTS=bidir KVO_BENCH_TOTAL_MIB=2048 timeout 420 ../build/gpuJ/bench.test -test.run 'TestKernelVariants$' -test.v -test.timeout 8m > "$R/kvar.log" 2>&1); echo "sweep rc=$?"
cat "$R/info.txt"
grep -E '^(Link|\| kvo|Pick|No variant|--- FAIL|panic)' "$R/kvar.log" | cut -c1-900
