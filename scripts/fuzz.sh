#!/usr/bin/env bash
# Runs every Fuzz target of the module for FUZZTIME each (default 10s).
# `go test -fuzz` takes one target of one package per run, so this finds them
# all and runs them in turn; a failing input is written by Go under the
# package's testdata/fuzz/<Target>/ and should be committed with the fix.
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZTIME=${FUZZTIME:-10s}
fail=0
while IFS=: read -r file target; do
  pkg=./$(dirname "$file")
  echo "== $pkg $target ($FUZZTIME)"
  if ! go test -run '^$' -fuzz "^${target}\$" -fuzztime "$FUZZTIME" "$pkg"; then
    fail=1
  fi
done < <(grep -rHoE --include='*_test.go' '^func Fuzz[A-Za-z0-9_]*' . | sed -E 's|^\./||; s|:func |:|' | sort)
exit $fail
