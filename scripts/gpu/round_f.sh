#!/usr/bin/env bash
# Compile kernels.cu to PTX here, run the cudacopy GPU tests with it, then
# the kvo_copy_probe sweep (KVO_BENCH_VARIANTS=probe, 2 GiB per run).
# Binaries: build/gpuF (transfer_cudacopy.test, bench.test).
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT/f"; R=$OUT/f
B=$PWD/build/gpuF
nvcc -ptx -arch=compute_80 -O3 -o "$OUT/kernels.ptx" transfer/cudacopy/kernels.cu && sed -i 's/^\.version .*/.version 7.0/' "$OUT/kernels.ptx"; echo "ptx rc=$?"
nvcc -cubin -arch=sm_90 -O3 -Xptxas -v -o /tmp/kernels.cubin transfer/cudacopy/kernels.cu > "$R/ptxas.txt" 2>&1; echo "cubin rc=$?"
export KVO_REQUIRE_GPU=1 KVO_BENCH_OUT=$R KVO_PTX_FILE=$OUT/kernels.ptx
(cd transfer/cudacopy && "$B/transfer_cudacopy.test" -test.run GPU -test.v -test.timeout 3m > "$R/cudacopy.log" 2>&1); echo "cudacopy rc=$?"
(cd bench && KVO_BENCH_VARIANTS=${KVO_BENCH_VARIANTS:-probe} KVO_BENCH_TOTAL_MIB=${KVO_BENCH_TOTAL_MIB:-2048} timeout ${SWEEP_TIMEOUT:-400} "$B/bench.test" -test.run 'TestKernelVariants$' -test.v -test.timeout 7m > "$R/kvar.log" 2>&1); echo "sweep rc=$?"
(cd "$OUT" && tar czf f.tgz f && rm -rf f)
tar xzOf "$OUT/f.tgz" f/ptxas.txt | grep -E 'Function properties|registers|spill' | paste - - - | sed 's/ptxas info    ://g' | grep kvo_copy | cut -c1-160
tar xzOf "$OUT/f.tgz" f/cudacopy.log | grep -E '^(--- |ok|FAIL|panic)' | sort | uniq -c
tar xzOf "$OUT/f.tgz" f/kvar.log | grep -E '^(Link|\| kvo|Pick|No variant|--- FAIL|panic)' | cut -c1-700
