#!/usr/bin/env bash
# The end-to-end device call: GPU tests of every package, the 64 GiB pool timing,
# the demo and a soak on the CUDA backend, the Python package on real torch tensors,
# and the pinning comparison. Binaries come packed in build/gpuA.tgz (size limit).
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT/r"; R=$OUT/r
tar xzf build/gpuA.tgz -C build
export KVO_REQUIRE_GPU=1 KVO_BENCH_OUT=$R
bash scripts/gpu/run.sh "${KVO_TESTS:-.}" -- -test.run 'GPU' -test.timeout 5m > "$R/tests.txt" 2>&1
cp "$OUT"/*.log "$R/" 2>/dev/null
(cd offload && KVO_BIG=1 ../build/gpu/offload.test -test.run 'TestGPUPool64' -test.v -test.timeout 3m > "$R/pool64.log" 2>&1); echo "pool64 rc=$?"
build/gpu/kvoffload info > "$R/info.txt" 2>&1
build/gpu/kvoffload demo --backend cuda --duration ${DEMO_DURATION:-30s} > "$R/demo.txt" 2>&1; echo "demo rc=$?"
build/gpu/kvoffload-soak soak --backend cuda --duration ${SOAK_DURATION:-60s} > "$R/soak.txt" 2>&1; echo "soak rc=$?"
export KVOFFLOAD_LIB=$PWD/build/gpu/libkvoffload.so PYTHONUNBUFFERED=1
timeout 240 python3 -m unittest discover -s python/tests -t python -v > "$R/python.txt" 2>&1; echo "python rc=$?"
PYTHONPATH=python timeout 120 python3 examples/torch_offload.py > "$R/example.txt" 2>&1; echo "example rc=$?"
[ -n "${SKIP_PINNING:-}" ] || build/gpu/kvoffload bench --only pinning --pool-sizes 1GiB,16GiB,48GiB --out "$R/pinning" > "$R/pinning.txt" 2>&1; echo "pinning rc=$?"
(cd "$OUT" && tar czf final.tgz r && rm -rf r ./*.log)
x() { tar xzOf "$OUT/final.tgz" "r/$1"; }
x tests.txt | tail -12
x pool64.log | grep -vE '^(=== RUN|PASS$)' | tail -12
x demo.txt | tail -22
x soak.txt | tail -8
x python.txt | grep -E '^(test_|Ran|OK|FAILED)|Error' | tail -40
x example.txt | tail -5
x pinning.txt | grep -E '^\| [0-9]|At 48' 
