#!/usr/bin/env bash
# Runs the GPU test binaries built by `make gpu-bins` on the GPU machine, with
# KVO_REQUIRE_GPU=1 so that a skipped GPU test fails, and prints a short table
# last. Usage: scripts/gpu/run.sh [binary-name-regexp] [-- extra test flags]
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT"
export KVO_REQUIRE_GPU=1 KVO_BENCH_OUT="$OUT"
filter=${1:-.}
shift || true
[ "${1:-}" = "--" ] && shift
summary=()
for bin in build/gpu/*.test; do
  name=$(basename "$bin" .test)
  echo "$name" | grep -Eq "$filter" || continue
  start=$(date +%s)
  pkgdir=$(echo "$name" | tr _ /)   # tests run in their package directory (testdata)
  [ -d "$pkgdir" ] || pkgdir=.
  (cd "$pkgdir" && "$OLDPWD/$bin" -test.v -test.count=1 -test.timeout=9m "$@") >"$OUT/$name.log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  pass=$(grep -c '^--- PASS' "$OUT/$name.log"); fail=$(grep -c '^--- FAIL' "$OUT/$name.log"); skip=$(grep -c '^--- SKIP' "$OUT/$name.log")
  summary+=("$(printf '%-28s rc=%-3s pass=%-4s fail=%-4s skip=%-4s %5ds' "$name" "$rc" "$pass" "$fail" "$skip" "$secs")")
  grep -E '^(--- FAIL|panic|FAIL)' -A15 "$OUT/$name.log" | head -60
done
echo; echo "== GPU test summary =="; printf '%s\n' "${summary[@]}"
