#!/usr/bin/env bash
# The batch-API sweep (KVO_BENCH_VARIANTS=batch): cuMemcpyBatchAsync spread
# over 1–8 streams per direction, and mixed kernel/batch sides both ways.
# Binaries: build/gpuE (bench.test, kernels.ptx).
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT/e"; R=$OUT/e
export KVO_REQUIRE_GPU=1 KVO_BENCH_OUT=$R KVO_PTX_FILE=$PWD/build/gpuE/kernels.ptx
(cd bench && KVO_BENCH_VARIANTS=${KVO_BENCH_VARIANTS:-batch} KVO_BENCH_TOTAL_MIB=${KVO_BENCH_TOTAL_MIB:-512} timeout ${SWEEP_TIMEOUT:-500} ../build/gpuE/bench.test -test.run 'TestKernelVariants$' -test.v -test.timeout 9m > "$R/kvar.log" 2>&1); echo "sweep rc=$?"
(cd "$OUT" && tar czf e.tgz e && rm -rf e)
tar xzOf "$OUT/e.tgz" e/kvar.log | grep -E '^(Link|\| |Pick|No variant|--- |FAIL|panic)' | cut -c1-900
