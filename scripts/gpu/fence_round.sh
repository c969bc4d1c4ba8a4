#!/usr/bin/env bash
# One device call for the fenced D2H copy kernel (kvo_copy_sys): compile
# kernels.cu to PTX (returned in $OUT for committing) and a cubin for the
# resource report, run the cudacopy GPU tests and the fence variant sweep
# with that PTX. Binaries from build/gpuF (transfer_cudacopy.test, bench.test).
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT"
export KVO_REQUIRE_GPU=1 KVO_BENCH_OUT=$OUT/logs
mkdir -p "$OUT/logs"
B=$PWD/build/gpuF
nvcc -ptx -arch=compute_80 -O3 -o "$OUT/kernels.ptx" transfer/cudacopy/kernels.cu && sed -i 's/^\.version .*/.version 7.0/' "$OUT/kernels.ptx"; echo "ptx rc=$?"
nvcc -cubin -arch=sm_90 -O3 -Xptxas -v -o /tmp/kernels.cubin transfer/cudacopy/kernels.cu > "$OUT/logs/ptxas.txt" 2>&1; echo "cubin rc=$?"
export KVO_PTX_FILE=$OUT/kernels.ptx
(cd transfer/cudacopy && timeout 200 "$B/transfer_cudacopy.test" -test.run GPU -test.v -test.timeout 3m > "$OUT/logs/cudacopy.log" 2>&1); echo "cudacopy rc=$?"
(cd bench && KVO_BENCH_VARIANTS=fence KVO_BENCH_TOTAL_MIB=${KVO_BENCH_TOTAL_MIB:-256} timeout 420 "$B/bench.test" -test.run 'TestKernelVariants$' -test.v -test.timeout 5m > "$OUT/logs/kvar.log" 2>&1); echo "sweep rc=$?"
grep -E 'Function properties|registers|spill' "$OUT/logs/ptxas.txt" | paste - - - | sed 's/ptxas info    ://g' | head -12
grep -hE '^(--- |ok|FAIL|panic)' "$OUT/logs/cudacopy.log" | sort | uniq -c
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
tar xzOf "$OUT/logs.tgz" logs/kvar.log | grep -E '^(Link|\| kvo|Pick|No variant)' | cut -c1-1200
