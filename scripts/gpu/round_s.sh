#!/usr/bin/env bash
# The issue-5 throughput benchmark alone, at the final code (binaries from
# `make gpu-bins`, packed as build/gpuG.tgz): a second sample after round_r's
# call landed on a machine instance whose contiguous link both ways measured
# 90 GB/s instead of 100.
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT/s"; R=$OUT/s
tar xzf build/gpuG.tgz -C build
timeout 220 build/gpu/kvoffload bench --only throughput --out "$R" --reps 3 > "$R/bench.log" 2>&1; echo "bench rc=$?"
grep -E 'Link \(contiguous' "$R/results.md"
grep -E 'target|met|MISSED' "$R/bench.log" | head -16
