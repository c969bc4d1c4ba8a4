#!/usr/bin/env bash
# Compile kernels.cu to PTX here (returned in $OUT for committing), with the
# sm_90 resource report and kvo_copy_probe's SASS around its read-back; run
# transfer/cudacopy's GPU tests and the issue-5 throughput benchmark with that
# PTX (`kvoffload bench --ptx`). Binaries: build/gpuI (kvoffload,
# transfer_cudacopy.test).
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT/i"; R=$OUT/i
B=$PWD/build/gpuI
nvcc -ptx -arch=compute_80 -O3 -o "$OUT/kernels.ptx" transfer/cudacopy/kernels.cu && sed -i 's/^\.version .*/.version 7.0/' "$OUT/kernels.ptx"; echo "ptx rc=$?"
nvcc -cubin -arch=sm_90 -O3 -Xptxas -v -o /tmp/kernels.cubin transfer/cudacopy/kernels.cu > "$R/ptxas.txt" 2>&1; echo "cubin rc=$?"
# The same PTX through ptxas for sm_90 (what the driver's JIT does), then SASS.
ptxas -arch=sm_90 -O3 -o /tmp/from-ptx.cubin "$OUT/kernels.ptx" && cuobjdump -sass -fun kvo_copy_probe /tmp/from-ptx.cubin > "$R/sass-probe.txt" 2>&1; echo "sass rc=$?"
export KVO_REQUIRE_GPU=1 KVO_PTX_FILE=$OUT/kernels.ptx
(cd transfer/cudacopy && "$B/transfer_cudacopy.test" -test.run GPU -test.v -test.timeout 3m > "$R/gpu-cudacopy.log" 2>&1); echo "cudacopy tests rc=$?"
timeout 420 "$B/kvoffload" bench --only throughput --out "$R" --reps 3 --ptx "$OUT/kernels.ptx" > "$R/bench.log" 2>&1; echo "bench rc=$?"
(cd "$OUT" && tar czf i.tgz i && rm -rf i)
x() { tar xzOf "$OUT/i.tgz" "i/$1"; }
x ptxas.txt | grep -E 'Function properties|registers|spill' | paste - - - | sed 's/ptxas info    ://g' | grep kvo_copy_probe | cut -c1-170
x sass-probe.txt | grep -n -B10 -A3 'STRONG.SYS' | head -30
x gpu-cudacopy.log | grep -E '^(--- |ok|FAIL|panic)' | sort | uniq -c
x bench.log | grep -E 'target|met|MISSED' | head -34
