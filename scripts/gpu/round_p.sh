#!/usr/bin/env bash
# After loads of whole blocks went staged (SubmitScatter): every package's GPU
# tests, the CUDA demo, the soak (tiny and 8b geometries, random layout kinds), the block benchmark, the
# Python package and the torch example. Binaries from `make gpu-bins` plus
# libkvoffload.so, packed as build/gpuG.tgz (as round_g.sh rest).
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT/p"; R=$OUT/p
tar xzf build/gpuG.tgz -C build
export KVO_REQUIRE_GPU=1 KVO_BENCH_OUT=$R
B=build/gpu
bash scripts/gpu/run.sh . -- -test.run 'GPU' -test.timeout 4m > "$R/tests.txt" 2>&1
cp "$OUT"/*.log "$R/" 2>/dev/null; rm -f "$OUT"/*.log
$B/kvoffload demo --backend cuda --duration 10s > "$R/demo.txt" 2>&1; echo "demo rc=$?"
$B/kvoffload-soak soak --backend cuda --duration 30s > "$R/soak.txt" 2>&1; echo "soak rc=$?"
$B/kvoffload-soak soak --backend cuda --duration 30s --layout 8b --pool-bytes 512MiB > "$R/soak-8b.txt" 2>&1; echo "soak 8b rc=$?"
(cd bench && KVO_BENCH_BLOCKS=1 "$OLDPWD/$B/bench.test" -test.run 'TestBlocksBench$' -test.v -test.timeout 4m > "$R/blocks.log" 2>&1); echo "blocks rc=$?"
export KVOFFLOAD_LIB=$PWD/$B/libkvoffload.so PYTHONUNBUFFERED=1
timeout 150 python3 -m unittest discover -s python/tests -t python -v > "$R/python.txt" 2>&1; echo "python rc=$?"
PYTHONPATH=python timeout 80 python3 examples/torch_offload.py > "$R/example.txt" 2>&1; echo "example rc=$?"
(cd "$OUT" && tar czf p.tgz p && rm -rf p)
x() { tar xzOf "$OUT/p.tgz" "p/$1"; }
x tests.txt | tail -10; x demo.txt | grep -iE 'gather|scatter|GB/s|verif' | head -6; x soak.txt | tail -4; x soak-8b.txt | tail -4
x python.txt | grep -E '^(Ran|OK|FAILED)|Error' | tail -4; x example.txt | tail -1
x blocks.log | grep -E '^(\||Stores|FAIL|panic)|Error' | head -30
