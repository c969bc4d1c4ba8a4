#!/usr/bin/env bash
# Benchmark call: `kvoffload info` and the issue-5 throughput benchmark
# (`kvoffload bench --only throughput`: the link, memcpy, batch, the kernel at
# its default launches and at 2/4/8/16 CTAs × 1024 unthrottled, auto; 2 GiB of
# random-slot segments, 4 KiB–2 MiB, each way and both at once, then beside a
# 4096² sgemm), after the GPU tests of transfer/cudacopy, transfer and offload
# (the copy paths the defaults touch). Binaries: build/gpuB.
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT/bench"
export KVO_REQUIRE_GPU=1
B=build/gpuB
$B/kvoffload info > "$OUT/bench/info.txt" 2>&1
for t in transfer_cudacopy transfer offload; do
  (cd "$(echo $t | tr _ /)" && "$OLDPWD/$B/$t.test" -test.run GPU -test.v -test.timeout 3m > "$OUT/bench/gpu-$t.log" 2>&1); echo "$t tests rc=$?"
done
$B/kvoffload bench --only throughput --out "$OUT/bench" --reps 3 > "$OUT/bench/bench.log" 2>&1; echo "bench rc=$?"
(cd "$OUT" && tar czf bench.tgz bench && rm -rf bench)
tar xzOf "$OUT/bench.tgz" bench/bench.log | grep -E 'target|met|MISSED' | head -60
for t in transfer_cudacopy transfer offload; do tar xzOf "$OUT/bench.tgz" bench/gpu-$t.log | grep -E '^(--- |ok|FAIL|panic)' | sort | uniq -c; done
