#!/usr/bin/env bash
# One GPU-machine call: functional GPU tests of every package, then the
# benchmarks selected by KVO_ROUND (quick|full). Prints a summary table last.
set -u
OUT=${OUT:-/tmp/kvo-out}; mkdir -p "$OUT"
export KVO_REQUIRE_GPU=1 KVO_BENCH_OUT="$OUT" KVO_RESULTS_DIR="$OUT"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader | tee "$OUT/machine.txt"
bash scripts/gpu/run.sh "${KVO_TESTS:-internal_cuda|register|transfer|bench|offload}" -- -test.run "${KVO_RUN:-GPU}" -test.timeout 5m 2>&1 | tee "$OUT/tests.txt" | tail -40
bench() { # name binary args...
  local name=$1 bin=$2; shift 2
  local pkgdir; pkgdir=$(basename "$bin" .test | tr _ /)
  echo "== $name"; (cd "$pkgdir" && KVO_REQUIRE_GPU=1 timeout 300 "$OLDPWD/$bin" "$@") > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"
  grep -vE '^(=== RUN|--- PASS|PASS|ok )' "$OUT/$name.log" | tail -${TAILN:-25}
}
for b in ${KVO_BENCHES:-}; do
  case $b in
    throughput) bench throughput build/gpu/bench.test -test.run 'TestThroughputBench$' -test.v ;;
    pinning)    bench pinning build/gpu/bench.test -test.run 'TestPinningBench$' -test.v ;;
    completion) KVO_IDLE_SECONDS=${KVO_IDLE_SECONDS:-10} bench completion build/gpu/transfer.test -test.run '^$' -test.bench 'GPUCompletion|GPUTimeToFirstLayer' -test.benchtime 1x ;;
    control)    bench control build/gpu/kvcache.test -test.run '^$' -test.bench ControlPlane -test.benchtime 20000x -test.cpu 1,16 ;;
    pool64)     KVO_BIG=1 bench pool64 build/gpu/offload.test -test.run 'Pool64|BigPool' -test.v ;;
  esac
done
# The device tool brings back at most 8 files: pack the logs into one.
(cd "$OUT" && tar czf logs.tgz --exclude logs.tgz ./*.log ./*.md ./*.csv ./*.json ./*.txt 2>/dev/null && find . -maxdepth 1 -type f ! -name logs.tgz ! -name '*.md' -delete)
echo; echo "== summary"; grep -A30 '== GPU test summary' <(tar xzOf "$OUT/logs.tgz" ./tests.txt) | tail -n +2
