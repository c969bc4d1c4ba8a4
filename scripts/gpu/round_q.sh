#!/usr/bin/env bash
# The engine's staged copies counted: the CUDA demo (8b blocks, 2 MiB of 32 KiB
# segments; then tiny blocks, which are not staged) and the soak with invariants
# on 8b blocks. Binaries: build/gpuQ (kvoffload, kvoffload-soak).
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT/q"; R=$OUT/q
B=build/gpuQ
$B/kvoffload demo --backend cuda --duration 10s > "$R/demo-8b.txt" 2>&1; echo "demo 8b rc=$?"
$B/kvoffload demo --backend cuda --duration 5s --layout tiny > "$R/demo-tiny.txt" 2>&1; echo "demo tiny rc=$?"
$B/kvoffload-soak soak --backend cuda --duration 30s --layout 8b --pool-bytes 512MiB > "$R/soak-8b.txt" 2>&1; echo "soak 8b rc=$?"
grep -E 'layout|stored|loaded|staged|verification' "$R/demo-8b.txt" "$R/demo-tiny.txt"
tail -8 "$R/soak-8b.txt"
