#!/usr/bin/env bash
# Gathered stores: GPU tests of transfer/cudacopy (SubmitGather round trips),
# transfer and offload, then the block-store benchmark (bench.test
# TestBlocksBench). Binaries: build/gpuC.
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT/c"; R=$OUT/c
export KVO_REQUIRE_GPU=1 KVO_BENCH_OUT=$R
B=$PWD/build/gpuC
for t in transfer_cudacopy transfer offload; do
  (cd "$(echo $t | tr _ /)" && "$B/$t.test" -test.run GPU -test.v -test.timeout 3m > "$R/gpu-$t.log" 2>&1); echo "$t tests rc=$?"
done
(cd bench && KVO_BENCH_BLOCKS=1 "$B/bench.test" -test.run 'TestBlocksBench$' -test.v -test.timeout 6m > "$R/blocks.log" 2>&1); echo "blocks rc=$?"
(cd "$OUT" && tar czf c.tgz c && rm -rf c)
for t in transfer_cudacopy transfer offload; do tar xzOf "$OUT/c.tgz" c/gpu-$t.log | grep -E '^(--- |ok|FAIL|panic)' | sort | uniq -c; done
tar xzOf "$OUT/c.tgz" c/blocks.log | grep -E '^(\||Stores|FAIL|panic)|Error' | head -40
