#!/usr/bin/env bash
# Verification call, run first on a freshly started machine: the 64 GiB pool
# timing while its memory is still cold (never touched by the guest), then
# the GPU tests of every package with KVO_REQUIRE_GPU=1, the CUDA demo and
# soak, and the Python package on torch tensors. Binaries: build/gpuA.tgz.
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT/r"; R=$OUT/r
tar xzf build/gpuA.tgz -C build
export KVO_REQUIRE_GPU=1 KVO_BENCH_OUT=$R
(cd offload && KVO_BIG=1 ../build/gpu/offload.test -test.run 'TestGPUPool64' -test.v -test.timeout 3m > "$R/pool64.log" 2>&1); echo "pool64 rc=$?"
cp "$R/pool64.md" "$R/pool64-cold.md" 2>/dev/null
(cd offload && KVO_BIG=1 ../build/gpu/offload.test -test.run TestGPUPool64 -test.v -test.timeout 3m > "$R/pool64-warm.log" 2>&1); echo "pool64 warm rc=$?"
cp "$R/pool64.md" "$R/pool64-warm.md" 2>/dev/null
(cd offload && KVO_PREFAULT_THREADS=12 KVO_BIG=1 ../build/gpu/offload.test -test.run TestGPUPool64 -test.v -test.timeout 3m > "$R/pool64-warm12.log" 2>&1); echo "pool64 warm 12 rc=$?"
cp "$R/pool64.md" "$R/pool64-warm12.md" 2>/dev/null
bash scripts/gpu/run.sh "${KVO_TESTS:-.}" -- -test.run 'GPU' -test.timeout 5m > "$R/tests.txt" 2>&1
cp "$OUT"/*.log "$R/" 2>/dev/null
build/gpu/kvoffload info > "$R/info.txt" 2>&1
build/gpu/kvoffload demo --backend cuda --duration ${DEMO_DURATION:-20s} > "$R/demo.txt" 2>&1; echo "demo rc=$?"
build/gpu/kvoffload-soak soak --backend cuda --duration ${SOAK_DURATION:-40s} > "$R/soak.txt" 2>&1; echo "soak rc=$?"
export KVOFFLOAD_LIB=$PWD/build/gpu/libkvoffload.so PYTHONUNBUFFERED=1
timeout 200 python3 -m unittest discover -s python/tests -t python -v > "$R/python.txt" 2>&1; echo "python rc=$?"
PYTHONPATH=python timeout 100 python3 examples/torch_offload.py > "$R/example.txt" 2>&1; echo "example rc=$?"
(cd "$OUT" && tar czf final.tgz r && rm -rf r ./*.log)
x() { tar xzOf "$OUT/final.tgz" "r/$1"; }
x tests.txt | tail -12
echo "== pool64 cold"; x pool64-cold.md
echo "== pool64 warm"; x pool64-warm.md | head -4
echo "== pool64 warm, 12 prefault threads"; x pool64-warm12.md | head -4
x demo.txt | tail -12
x soak.txt | tail -5
x python.txt | grep -E '^(Ran|OK|FAILED)|Error' | tail -8
x example.txt | tail -3
