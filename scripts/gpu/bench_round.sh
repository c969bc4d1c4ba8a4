#!/usr/bin/env bash
# Benchmarks for bench/results in one device call: `kvoffload info`, `kvoffload bench`
# (throughput sweep + pinning, CSV/JSON/SVG/markdown), completion latency with a 10 s
# idle window, and the PyTorch peers side by side. Binaries from build/gpuB.
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT/bench"
export KVO_REQUIRE_GPU=1
B=build/gpuB
$B/kvoffload info > "$OUT/bench/info.txt" 2>&1
$B/kvoffload bench --out "$OUT/bench" --reps 3 --pool-sizes 1GiB,16GiB,48GiB > "$OUT/bench/bench.log" 2>&1; echo "bench rc=$?"
(cd transfer && KVO_IDLE_SECONDS=10 ../$B/transfer.test -test.run '^$' -test.bench 'GPUCompletion|GPUTimeToFirstLayer' -test.benchtime 1x) > "$OUT/bench/completion.log" 2>&1; echo "completion rc=$?"
PYTHONUNBUFFERED=1 timeout 240 python3 bench/peers/peers.py --out "$OUT/bench" > "$OUT/bench/peers.log" 2>&1; echo "peers rc=$?"
python3 bench/peers/merge.py "$OUT/bench" > "$OUT/bench/merge.log" 2>&1; echo "merge rc=$?"
(cd "$OUT" && tar czf bench.tgz bench && rm -rf bench)
tar xzOf "$OUT/bench.tgz" bench/completion.log | grep -E '^\|'
tar xzOf "$OUT/bench.tgz" bench/bench.log | grep -iE 'target|met|MISSED|GiB/s' | head -40
tar xzOf "$OUT/bench.tgz" bench/peers.log | tail -15
