#!/usr/bin/env bash
# Kernel-shape and prefault sweeps (see bench/throughput.go, bench/pinning.go), with the PTX
# regenerated in the same call, plus the GPU tests of the packages touched.
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT"
make ptx >/dev/null; P=$PWD/transfer/cudacopy/kernels.ptx; cp "$P" "$OUT/kernels.ptx"
export KVO_REQUIRE_GPU=1 KVO_PTX_FILE=$P
KVO_TESTS='internal_cuda|^transfer|register' bash scripts/gpu/run.sh 'internal_cuda|^transfer|register' -- -test.run 'GPU' > "$OUT/tests.txt" 2>&1
(cd bench && KVO_PIN_VARIANT_GIB=8 ../build/gpu/bench.test -test.run 'TestPinningVariants$' -test.v > "$OUT/pinvar.log" 2>&1)
(cd bench && KVO_BENCH_VARIANTS=1 KVO_BENCH_OUT=$OUT ../build/gpu/bench.test -test.run 'TestKernelVariants$' -test.v -test.timeout 8m > "$OUT/kvar.log" 2>&1)
(cd "$OUT" && tar czf logs.tgz --exclude logs.tgz --exclude kernels.ptx ./* && find . -maxdepth 1 -type f ! -name logs.tgz ! -name kernels.ptx -delete)
tar xzOf "$OUT/logs.tgz" ./tests.txt | tail -8
tar xzOf "$OUT/logs.tgz" ./pinvar.log | grep -vE '^(=== RUN|--- PASS|PASS)' | tail -30
tar xzOf "$OUT/logs.tgz" ./kvar.log | grep -vE '^(=== RUN|--- PASS|PASS)' | tail -45
