#!/usr/bin/env bash
# One device-tool call: compile the kernels to PTX and report what the machine offers.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,memory.total --format=csv
nvcc --version | tail -2
make ptx NVCC=nvcc 2>&1 || nvcc -ptx -arch=compute_80 -O3 -o transfer/cudacopy/kernels.ptx transfer/cudacopy/kernels.cu
head -20 transfer/cudacopy/kernels.ptx | grep -E '^\.(version|target|address_size)'
cp transfer/cudacopy/kernels.ptx "$OUT/"
ptxas -arch=sm_90 -v transfer/cudacopy/kernels.ptx -o /dev/null 2>&1 | tee "$OUT/ptxas.txt"
# PTX ISA floor: does it assemble when the .version is lowered?
for v in 6.0 6.3 7.0 7.4 8.0; do
  sed "s/^\.version .*/.version $v/" transfer/cudacopy/kernels.ptx > /tmp/k$v.ptx
  if ptxas -arch=sm_80 /tmp/k$v.ptx -o /dev/null 2>/tmp/e$v; then echo "ptx isa $v: ok"; else echo "ptx isa $v: FAIL $(head -c 200 /tmp/e$v)"; fi
done
LIB=$(ldconfig -p | awk '/libcuda.so.1/{print $NF; exit}'); echo "libcuda: $LIB"
nm -D "$LIB" | grep -E 'cuMemcpyBatchAsync|cuMemHostRegister|cuThreadExchangeStreamCaptureMode|cuEventRecordWithFlags|cuGraphInstantiate' 
cat /sys/kernel/mm/transparent_hugepage/enabled; grep -E 'HugePages_Total|MemAvailable|MemTotal' /proc/meminfo; ulimit -l
cat /sys/fs/cgroup/memory.max 2>/dev/null; nproc; numactl -H 2>/dev/null | head -3
BUS=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1); echo "bus $BUS"; cat /sys/bus/pci/devices/$(echo $BUS | tr 'A-F' 'a-f' | sed 's/^0000\(....\)/\1/' )/numa_node 2>/dev/null
ls /sys/bus/pci/devices/ | head -3; python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
grep -E 'cuMemcpyBatchAsync' -A12 /usr/local/cuda/include/cuda.h | head -60
grep -nE 'CU_MEMCPY_SRC_ACCESS_ORDER_|typedef struct CUmemcpyAttributes_st|CU_MEM_LOCATION_TYPE_' /usr/local/cuda/include/cuda.h | head -20
