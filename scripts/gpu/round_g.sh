#!/usr/bin/env bash
# Final calls of a session, binaries from `make gpu-bins` plus
# libkvoffload.so packed as build/gpuG.tgz.
#   bash scripts/gpu/round_g.sh bench  — the cudacopy GPU tests, then the issue-5
#     throughput benchmark (`kvoffload bench --only throughput --reps 3`).
#   bash scripts/gpu/round_g.sh rest   — every package's GPU tests, the CUDA demo
#     and soak, the block benchmark, the Python package and the torch example.
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT/g"; R=$OUT/g
tar xzf build/gpuG.tgz -C build
export KVO_REQUIRE_GPU=1 KVO_BENCH_OUT=$R
B=build/gpu
case "${1:-bench}" in
bench)
  (cd transfer/cudacopy && "$OLDPWD/$B/transfer_cudacopy.test" -test.run GPU -test.v -test.timeout 3m > "$R/gpu-cudacopy.log" 2>&1); echo "cudacopy tests rc=$?"
  $B/kvoffload info > "$R/info.txt" 2>&1
  timeout 480 $B/kvoffload bench --only throughput --out "$R" --reps 3 > "$R/bench.log" 2>&1; echo "bench rc=$?"
  (cd "$OUT" && tar czf g.tgz g && rm -rf g)
  tar xzOf "$OUT/g.tgz" g/gpu-cudacopy.log | grep -E '^(--- |ok|FAIL|panic)' | sort | uniq -c
  tar xzOf "$OUT/g.tgz" g/bench.log | grep -E 'target|met|MISSED' | head -40
  ;;
rest)
  bash scripts/gpu/run.sh . -- -test.run 'GPU' -test.timeout 4m > "$R/tests.txt" 2>&1
  cp "$OUT"/*.log "$R/" 2>/dev/null; rm -f "$OUT"/*.log
  $B/kvoffload demo --backend cuda --duration 10s > "$R/demo.txt" 2>&1; echo "demo rc=$?"
  $B/kvoffload-soak soak --backend cuda --duration 30s > "$R/soak.txt" 2>&1; echo "soak rc=$?"
  (cd bench && KVO_BENCH_BLOCKS=1 "$OLDPWD/$B/bench.test" -test.run 'TestBlocksBench$' -test.v -test.timeout 4m > "$R/blocks.log" 2>&1); echo "blocks rc=$?"
  export KVOFFLOAD_LIB=$PWD/$B/libkvoffload.so PYTHONUNBUFFERED=1
  timeout 150 python3 -m unittest discover -s python/tests -t python -v > "$R/python.txt" 2>&1; echo "python rc=$?"
  PYTHONPATH=python timeout 80 python3 examples/torch_offload.py > "$R/example.txt" 2>&1; echo "example rc=$?"
  (cd "$OUT" && tar czf g2.tgz g && rm -rf g)
  x() { tar xzOf "$OUT/g2.tgz" "g/$1"; }
  x tests.txt | tail -10; x demo.txt | tail -3; x soak.txt | tail -3
  x python.txt | grep -E '^(Ran|OK|FAILED)|Error' | tail -4; x example.txt | tail -1
  x blocks.log | grep -E '^(\||Stores|FAIL|panic)|Error' | head -30
  ;;
esac
