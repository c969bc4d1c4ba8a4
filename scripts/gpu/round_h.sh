#!/usr/bin/env bash
# kvo_copy_probe's D2H grid (KVO_BENCH_VARIANTS=probegrid, 2 GiB per run, the
# embedded PTX), H2D at its default launch. Binaries: build/gpuH (bench.test).
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT/h"; R=$OUT/h
export KVO_REQUIRE_GPU=1 KVO_BENCH_OUT=$R
(cd bench && KVO_BENCH_VARIANTS=probegrid KVO_BENCH_TOTAL_MIB=2048 timeout 300 ../build/gpuH/bench.test -test.run 'TestKernelVariants$' -test.v -test.timeout 6m > "$R/kvar.log" 2>&1); echo "sweep rc=$?"
(cd "$OUT" && tar czf h.tgz h && rm -rf h)
tar xzOf "$OUT/h.tgz" h/kvar.log | grep -E '^(Link|\| kvo|Pick|No variant|--- FAIL|panic)' | cut -c1-700
