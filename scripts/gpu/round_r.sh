#!/usr/bin/env bash
# Last call of session 4, at the final code: the GPU tests of transfer/cudacopy,
# transfer and offload, a 15 s soak on 8b blocks (staged both ways), then the
# issue-5 throughput benchmark. Binaries from `make gpu-bins`, packed as
# build/gpuG.tgz.
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT/r"; R=$OUT/r
tar xzf build/gpuG.tgz -C build
export KVO_REQUIRE_GPU=1 KVO_BENCH_OUT=$R
B=build/gpu
bash scripts/gpu/run.sh 'transfer|offload' -- -test.run 'GPU' -test.timeout 3m > "$R/tests.txt" 2>&1
cp "$OUT"/*.log "$R/" 2>/dev/null; rm -f "$OUT"/*.log
$B/kvoffload-soak soak --backend cuda --duration 15s --layout 8b --pool-bytes 512MiB > "$R/soak-8b.txt" 2>&1; echo "soak 8b rc=$?"
timeout 300 $B/kvoffload bench --only throughput --out "$R" --reps 3 > "$R/bench.log" 2>&1; echo "bench rc=$?"
(cd "$OUT" && tar czf r.tgz r && rm -rf r)
x() { tar xzOf "$OUT/r.tgz" "r/$1"; }
x tests.txt | tail -5; x soak-8b.txt | tail -5
x bench.log | grep -E 'target|met|MISSED' | head -16
