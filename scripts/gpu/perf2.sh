#!/usr/bin/env bash
# Gated throughput (full sweep), kernel-shape sweep, pinning cold/warm, control plane.
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT"
export KVO_REQUIRE_GPU=1 KVO_BENCH_OUT=$OUT
(cd transfer/cudacopy && ../../build/gpu/transfer_cudacopy.test -test.run GPU -test.v -test.timeout 2m > $OUT/cudacopy.log 2>&1)
(cd bench && KVO_BENCH_VARIANTS=1 ../build/gpu/bench.test -test.run 'TestKernelVariants$' -test.v -test.timeout 3m > $OUT/kvar.log 2>&1)
(cd bench && KVO_BENCH_FULL=1 KVO_BENCH_REPS=3 ../build/gpu/bench.test -test.run 'TestThroughputBench$' -test.v -test.timeout 5m > $OUT/throughput.log 2>&1)
(cd bench && KVO_PIN_SIZES=1,16,48 ../build/gpu/bench.test -test.run 'TestPinningBench$' -test.v -test.timeout 3m > $OUT/pinning.log 2>&1)
(cd kvcache && ../build/gpu/kvcache.test -test.run '^$' -test.bench ControlPlane -test.benchtime 20000x -test.cpu 1,16 > $OUT/control.log 2>&1)
grep -hE '^(--- |ok|FAIL|panic)' $OUT/*.log | sort | uniq -c | sort -rn | head
(cd "$OUT" && tar czf logs.tgz --exclude logs.tgz ./* && find . -maxdepth 1 -type f ! -name logs.tgz -delete)
tar xzOf $OUT/logs.tgz ./kvar.log | tail -4
tar xzOf $OUT/logs.tgz ./throughput.md | head -60
tar xzOf $OUT/logs.tgz ./pinning.md | head -14
grep -E 'ns/block' <(tar xzOf $OUT/logs.tgz ./control.log)
