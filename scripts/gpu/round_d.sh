#!/usr/bin/env bash
# One device call: compile kernels.cu to PTX (returned in $OUT for
# committing) and a cubin for the resource report; every package's GPU tests
# with that PTX (transfer/cudacopy reads KVO_PTX_FILE; the other packages use
# the embedded one), the CUDA demo and soak, the Python package and the torch
# example; then a kernel sweep (KVO_BENCH_VARIANTS, default fence) over 2 GiB
# per run. Binaries: build/gpuD.tgz (make gpu-bins + libkvoffload.so).
# store-sweep-2g.md came from this script at commit 97f1c4c with
# KVO_BENCH_VARIANTS=store (write-through and acq_rel-fenced kernels, since
# removed: they changed nothing).
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT/d"; R=$OUT/d
tar xzf build/gpuD.tgz -C build
nvcc -ptx -arch=compute_80 -O3 -o "$OUT/kernels.ptx" transfer/cudacopy/kernels.cu && sed -i 's/^\.version .*/.version 7.0/' "$OUT/kernels.ptx"; echo "ptx rc=$?"
nvcc -cubin -arch=sm_90 -O3 -Xptxas -v -o /tmp/kernels.cubin transfer/cudacopy/kernels.cu > "$R/ptxas.txt" 2>&1; echo "cubin rc=$?"
export KVO_REQUIRE_GPU=1 KVO_BENCH_OUT=$R KVO_PTX_FILE=$OUT/kernels.ptx
bash scripts/gpu/run.sh . -- -test.run 'GPU' -test.timeout 4m > "$R/tests.txt" 2>&1
cp "$OUT"/*.log "$R/" 2>/dev/null; rm -f "$OUT"/*.log
build/gpu/kvoffload demo --backend cuda --duration ${DEMO_DURATION:-10s} > "$R/demo.txt" 2>&1; echo "demo rc=$?"
build/gpu/kvoffload-soak soak --backend cuda --duration ${SOAK_DURATION:-30s} > "$R/soak.txt" 2>&1; echo "soak rc=$?"
export KVOFFLOAD_LIB=$PWD/build/gpu/libkvoffload.so PYTHONUNBUFFERED=1
timeout 150 python3 -m unittest discover -s python/tests -t python -v > "$R/python.txt" 2>&1; echo "python rc=$?"
PYTHONPATH=python timeout 80 python3 examples/torch_offload.py > "$R/example.txt" 2>&1; echo "example rc=$?"
(cd bench && KVO_BENCH_VARIANTS=${KVO_BENCH_VARIANTS:-fence} KVO_BENCH_TOTAL_MIB=${KVO_BENCH_TOTAL_MIB:-2048} timeout ${SWEEP_TIMEOUT:-380} ../build/gpu/bench.test -test.run 'TestKernelVariants$' -test.v -test.timeout 7m > "$R/kvar.log" 2>&1); echo "sweep rc=$?"
(cd "$OUT" && tar czf d.tgz d && rm -rf d)
x() { tar xzOf "$OUT/d.tgz" "d/$1"; }
x ptxas.txt | grep -E 'Function properties|registers|spill' | paste - - - | sed 's/ptxas info    ://g' | grep -E 'kvo_copy' | cut -c1-200
x tests.txt | tail -10
x demo.txt | tail -4; x soak.txt | tail -3
x python.txt | grep -E '^(Ran|OK|FAILED)|Error' | tail -5; x example.txt | tail -2
x kvar.log | grep -E '^(Link|\| kvo|Pick|No variant|--- |FAIL|panic)' | cut -c1-600
