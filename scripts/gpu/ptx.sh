#!/usr/bin/env bash
# Regenerates transfer/cudacopy/kernels.ptx on the GPU machine (the `make
# ptx` recipe) into $OUT, with the resource report (registers, spills) of
# the same source compiled for sm_90.
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT"
nvcc -ptx -arch=compute_80 -O3 -o "$OUT/kernels.ptx" transfer/cudacopy/kernels.cu && sed -i 's/^\.version .*/.version 7.0/' "$OUT/kernels.ptx"; echo "ptx rc=$?"
nvcc -cubin -arch=sm_90 -O3 -Xptxas -v -o /tmp/kernels.cubin transfer/cudacopy/kernels.cu > "$OUT/ptxas.txt" 2>&1; echo "cubin rc=$?"
grep -E 'Function properties|registers|spill' "$OUT/ptxas.txt" | paste - - - | sed 's/ptxas info    ://g' | cut -c1-170
