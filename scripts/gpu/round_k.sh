#!/usr/bin/env bash
# The batch API submitted from 1-8 threads at once (TestParallelBatch), 2 GiB
# of 4 and 16 KiB segments. Binaries: build/gpuJ (bench.test).
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT/k"; R=$OUT/k
export KVO_REQUIRE_GPU=1 KVO_BENCH_OUT=$R
grep -E 'AnonHugePages|MemFree' /proc/meminfo; cat /sys/kernel/mm/transparent_hugepage/enabled
(cd bench && KVO_BENCH_PARBATCH=1 timeout 400 ../build/gpuJ/bench.test -test.run 'TestParallelBatch$' -test.v -test.timeout 7m > "$R/parbatch.log" 2>&1); echo "parbatch rc=$?"
grep -E '^(Rss|Link|\| |--- FAIL|panic)' "$R/parbatch.log" | cut -c1-400
