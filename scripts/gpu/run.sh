#!/usr/bin/env bash
# shellcheck disable=SC2317,SC2001 # suite functions are called by name; sed reads plainer
# The one way to run kvoffload's GPU suites on the GPU machine, and to bring
# their results into bench/results/<machine>/.
#
#   bash scripts/gpu/run.sh SUITE...          run suites, results under $OUT
#   bash scripts/gpu/run.sh --list            the suites, one a line, with what they run
#   bash scripts/gpu/run.sh --collect FROM    copy fetched results (FROM: the folder
#                                             holding results.tar.gz, or the file) into
#                                             bench/results/<machine>/, replacing each
#                                             suite's earlier result
#
# Here (with Go): `make gpu-bins` builds every binary a suite needs into build/gpu/,
# records the commit, and packs them as build/gpu.tar.gz (under 60 MiB). There (no
# Go; Python 3.12, torch): this script unpacks that archive into build/gpu/, runs
# the suites in the order given, and for each writes <machine>/<suite>.txt (the
# command, the commit, the date and the machine at its top, then every command it
# ran with its output) and, where the suite writes tables, <machine>/<suite>/.
# After each suite it packs everything as $OUT/results.tar.gz and writes
# $OUT/summary.txt (a call stopped at its limit still returns what finished: two
# files, inside the device tool's 8). The short table
# (suite, rc, pass/fail/skip, seconds) is printed last; the exit status is 1 when
# any suite failed. A suite fails when a command of it fails or when a test skips:
# the GPU tests run with KVO_REQUIRE_GPU=1, which turns a missing GPU into a failure,
# and the opt-in tests that have suites of their own are left out by name.
#
# With the device tool (10 minutes a call), `all` takes two calls on one machine;
# pool64 goes first in the first call so that it meets a fresh VM's cold memory:
#   make gpu-bins                      # here, then with carry ["build/gpu.tar.gz"]:
#   bash scripts/gpu/run.sh pool64 tests demo soak python   # call 1, about 5 minutes
#   bash scripts/gpu/run.sh bench blocks                    # call 2, about 6 minutes
#   bash scripts/gpu/run.sh --collect /path/to/files_at     # here, once per call
# The wheel (not in all): `make wheel` here, carry ["dist"] (and build/gpu.tar.gz
# when other suites run in the same call), then `bash scripts/gpu/run.sh wheel`.
# then update bench/results/README.md's table from the headers of the new files.
#
# A new suite is one function, suite_NAME, run with the suite's folder in $D; it
# runs its commands through `step` (or `step_in DIR` for a test binary that reads
# its package's testdata), and is listed in SUITES (and ALL_SUITES when `all`
# should run it). `NAME:ARG` passes ARG to the function as $1 (its result is
# NAME-ARG.txt). Nothing here needs Go.
set -u

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT" || exit 2
B=$ROOT/build/gpu
ARCHIVE=$ROOT/build/gpu.tar.gz
OUT=${OUT:-/tmp/kvo-out}

# name|what it runs (for --list); ALL_SUITES is what `all` runs, in that order.
SUITES=(
	"tests|every package's GPU tests (-test.run GPU, KVO_REQUIRE_GPU=1)"
	"bench|kvoffload info; the throughput benchmark (kvoffload bench --only throughput --reps 3)"
	"blocks|the block-store benchmark (internal_benchgpu.test TestBlocksBench)"
	"tp|tensor-parallel sharing on the GPU: TestGPUTPSizeSharing, and a TP=4 rank's head-sliced stores and loads against the same-run link (offload.test BenchmarkGPUHeadSliced; not in all)"
	"paged|bench/realmodel.py's paged reload and store without the model, per copy method and part size, GPU side vs the same-run link, with call and per-layer times (offload.test BenchmarkGPUPagedReload; KVO_PR_VARIANTS, KVO_PR_BLOCKS; not in all)"
	"trace|where a paged reload's GPU time goes: bench/trace_reload.py under torch.profiler (CUPTI), per stream busy time and gaps, chrome traces (not in all)"
	"calltime|how long Engine.Store and Engine.Load of 128, 512 and 2048 8B-class blocks take to return, and a per-layer load's LayerEvent(0) (offload.test BenchmarkGPUCallTime)"
	"chunks|issue 51: staging chunks of 16 and 32 MiB (KVOFFLOAD_GATHER_CHUNK_MIB) against the default 8 in one call: the 2048-block calltime, traced, and bench/realmodel.py at each, its first store and load traced (not in all)"
	"pool64|a 64 GiB pool's start-up, twice: a fresh VM's cold memory, then warm (offload.test TestGPUPool64)"
	"pool64nice|warm 64 GiB pools, prefault at the caller's priority vs the default nice, alternating (not in all)"
	"multigpu_link|each GPU's host link alone and with the others at once, and nvidia-smi topo (not in all)"
	"demo|the CUDA demo, 8b blocks for 10 s and tiny blocks for 5 s"
	"soak|the soak with invariants on the CUDA backend, tiny and 8b blocks, 30 s each"
	"python|the Python package's tests on torch tensors, and examples/torch_offload.py"
	"realmodel|the real-model benchmark (python3 bench/realmodel.py): reload, store, per-layer readiness and call times against the same-run contiguous copies"
	"tfcb|transformers' continuous batching with kvoffload as its prefix and swap tier vs transformers alone (python3 bench/transformers_cb.py; not in all); tfcb:long, tfcb:batch, tfcb:atonce, tfcb:verify: the time steps (bench/tfcb_time.py)"
	"wheel|the wheel (make wheel here, carry dist) in a venv with the system's torch: python/tests against the installed copy"
	"nodepool|the node pool on one GPU: kvoffload serve and client processes with their own CUDA contexts: store here/load there, two at once vs one alone, SIGKILL mid-store, TP=2 ranks to TP=1, pinning vs the embedded engine (offload.test TestGPUNodePool; not in all)"
	"disk|the disk tier against fio on this machine's disk (internal_tier_disk.test TestDiskVsFio, Q = 1, 4, 16, 2 GiB passes), and Open's index scan (BenchmarkOpenScan); needs build/gpu-tools.tar.gz (not in all)"
	"cluster|the cluster tier against redis-benchmark --cluster on a 3-master Redis Cluster on loopback (internal_tier_cluster.test TestBenchVsRedisBenchmark), with a CPU profile; needs build/gpu-tools.tar.gz (not in all)"
	"realtier|a real model's KV reloaded from the disk tier and from a Redis Cluster on loopback, beside reload from host and recompute (python3 bench/realmodel.py --tier); needs build/gpu-tools.tar.gz (not in all)"
	"sweep:NAME|an exploration, not in all: NAME a KVO_BENCH_VARIANTS set (bidir, probe, probegrid, fence, batch) or parbatch, mixed, staged"
)
ALL_SUITES=(pool64 tests demo soak python realmodel calltime bench blocks)

# ---------------------------------------------------------------- the suites

suite_tests() {
	local bin name
	for bin in "$B"/*.test; do
		name=$(basename "$bin" .test)
		# Tests run in their package's folder (testdata). Left out: the 64 GiB pool
		# (pool64) and the CLI's checks for a machine without a driver.
		step_in "$(pkgdir "$name")" timeout 300 "$bin" -test.v -test.count=1 -test.timeout 4m \
			-test.run GPU -test.skip 'Pool64|WithoutGPU'
	done
}

suite_bench() {
	step "$B/kvoffload" info
	step timeout 420 "$B/kvoffload" bench --only throughput --reps 3 --out "$D"
}

suite_blocks() {
	KVO_BENCH_BLOCKS=1 KVO_BENCH_OUT=$D step_in internal/benchgpu timeout 300 "$B/internal_benchgpu.test" -test.v \
		-test.run 'TestBlocksBench$' -test.timeout 4m
}

suite_tp() {
	step_in offload timeout 120 "$B/offload.test" -test.v -test.count=1 -test.run 'TestGPUTPSizeSharing'
	KVO_BENCH_OUT=$D step_in offload timeout 240 "$B/offload.test" -test.run '^$' -test.bench 'GPUHeadSliced$' \
		-test.benchtime 5x -test.count 2 -test.v
}

suite_paged() {
	KVO_BENCH_OUT=$D KVO_PR_VARIANTS=${KVO_PR_VARIANTS:-auto kernel batch memcpy auto:part=128 auto:part=1024 auto:builders=1} \
		step_in offload timeout 300 "$B/offload.test" -test.run '^$' -test.bench 'GPUPagedReload$' -test.benchtime 5x -test.count 1
}

suite_trace() {
	KVOFFLOAD_LIB=$B/libkvoffload.so PYTHONUNBUFFERED=1 PYTHONPATH=python \
		step timeout 200 python3 bench/trace_reload.py --out "$D/trace.md"
}

suite_calltime() {
	step_in offload timeout 200 "$B/offload.test" -test.v -test.run '^$' -test.bench 'GPUCallTime$' \
		-test.benchtime 10x -test.count 3
	# Issue 51's open bound (LayerEvent(0) at 2048 blocks): where the
	# submitting thread's time goes until layer 0's events are recorded
	# (a traced line per call, up to "layer0"), and the same bench with
	# the pitched staging DMAs off (the test binaries are kvocompare builds).
	KVOFFLOAD_TRACE_CALLS=12 step_in offload timeout 60 "$B/offload.test" -test.v -test.run '^$' \
		-test.bench 'GPUCallTime$/blocks=2048' -test.benchtime 4x -test.count 1
	KVOFFLOAD_NO_PITCHED_STAGING=1 KVOFFLOAD_TRACE_CALLS=6 step_in offload timeout 60 "$B/offload.test" -test.v -test.run '^$' \
		-test.bench 'GPUCallTime$/blocks=2048' -test.benchtime 10x -test.count 1
	# Other staging chunk sizes: suite chunks.
}

# The staging chunk size's effect on layer 0 (issue 51): each size's
# 2048-block calltime, traced, and the real-model benchmark, the default
# (8 MiB) first, in one call so that the sizes compare on one machine.
suite_chunks() {
	local mib
	for mib in 8 16 32; do
		KVOFFLOAD_GATHER_CHUNK_MIB=$mib KVOFFLOAD_TRACE_CALLS=6 step_in offload timeout 60 "$B/offload.test" -test.v \
			-test.run '^$' -test.bench 'GPUCallTime$/blocks=2048' -test.benchtime 10x -test.count 2
		# The engine's first two calls traced: the first store and load of 2k.
		KVOFFLOAD_GATHER_CHUNK_MIB=$mib KVOFFLOAD_TRACE_CALLS=2 KVOFFLOAD_LIB=$B/libkvoffload.so PYTHONUNBUFFERED=1 \
			PYTHONPATH=python step timeout 270 python3 bench/realmodel.py --out "$D/realmodel-chunk$mib.md"
	done
}

suite_pool64() {
	local run
	for run in first second; do
		KVO_BIG=1 KVO_BENCH_OUT=$D step_in offload timeout 180 "$B/offload.test" -test.v \
			-test.run 'TestGPUPool64$' -test.timeout 3m
		[ -f "$D/pool64.md" ] && mv "$D/pool64.md" "$D/pool64-$run.md"
	done
}

# Warm 64 GiB pools with the prefault threads at the caller's priority
# (KVO_PREFAULT_NICE=-1) and at the default nice, alternating, twice each:
# what lowering their priority costs on idle CPUs, on one machine.
suite_pool64nice() {
	local run nice
	for run in 1 2; do
		for nice in -1 0; do
			KVO_BIG=1 KVO_PREFAULT_NICE=$nice KVO_BENCH_OUT=$D step_in offload timeout 180 "$B/offload.test" -test.v \
				-test.run 'TestGPUPool64$' -test.timeout 3m
			[ -f "$D/pool64.md" ] && mv "$D/pool64.md" "$D/pool64-nice$nice-$run.md"
		done
	done
}

# The host link of each GPU alone and with the others at once, and the
# topology: the reference of the runs on several GPUs (issue 29).
suite_multigpu_link() {
	PYTHONUNBUFFERED=1 step timeout 300 python3 bench/multigpu_link.py --out "$D/multigpu-link.md"
}

suite_demo() {
	step timeout 60 "$B/kvoffload" demo --backend cuda --duration 10s
	step timeout 40 "$B/kvoffload" demo --backend cuda --duration 5s --layout tiny
}

suite_soak() {
	step timeout 90 "$B/kvoffload-soak" soak --backend cuda --duration 30s
	step timeout 90 "$B/kvoffload-soak" soak --backend cuda --duration 30s --layout 8b --pool-bytes 512MiB
}

suite_python() {
	# KVOFFLOAD_BIN: the CLI make gpu-bins built, for the node tests (kvoffload serve).
	KVOFFLOAD_LIB=$B/libkvoffload.so KVOFFLOAD_BIN=$B/kvoffload PYTHONUNBUFFERED=1 \
		step timeout 240 python3 -m unittest discover -s python/tests -t python -v
	KVOFFLOAD_LIB=$B/libkvoffload.so PYTHONUNBUFFERED=1 PYTHONPATH=python \
		step timeout 120 python3 examples/torch_offload.py
}

# The wheel make wheel built here (carry ["dist"], with or without
# build/gpu.tar.gz): installed with pip --no-index into a venv made with
# --system-site-packages (torch is in the system's site), python/tests run
# against the installed copy outside the source tree (scripts/wheel_test.sh).
suite_wheel() {
	PYTHONUNBUFFERED=1 step timeout 420 bash scripts/wheel_test.sh --system-site-packages
}

suite_realmodel() {
	if [ ! -f bench/realmodel.py ]; then
		echo "bench/realmodel.py does not exist at this commit" >>"$F"
		return 1
	fi
	KVOFFLOAD_LIB=$B/libkvoffload.so PYTHONUNBUFFERED=1 PYTHONPATH=python \
		step timeout 270 python3 bench/realmodel.py --out "$D/realmodel.md"
	# KVO_REALMODEL_WHOLE=1 adds the per-layer load's first layer built as
	# one part (the way before the first layer was cut into parts), and
	# KVO_REALMODEL_NOPITCH=1 the layers through the copy kernel instead of
	# the pitched staging DMAs: the comparisons in the same call.
	if [ "${KVO_REALMODEL_WHOLE:-0}" = 1 ]; then
		KVOFFLOAD_LIB=$B/libkvoffload.so PYTHONUNBUFFERED=1 PYTHONPATH=python KVOFFLOAD_WHOLE_FIRST_LAYER=1 \
			step timeout 270 python3 bench/realmodel.py --out "$D/realmodel-whole.md"
	fi
	if [ "${KVO_REALMODEL_NOPITCH:-0}" = 1 ]; then
		KVOFFLOAD_LIB=$B/libkvoffload.so PYTHONUNBUFFERED=1 PYTHONPATH=python KVOFFLOAD_NO_PITCHED_STAGING=1 \
			step timeout 270 python3 bench/realmodel.py --out "$D/realmodel-nopitch.md"
	fi
	return 0
}

# transformers' continuous batching (random-weight Llama, paged|sdpa) with
# kvoffload.integrations.transformers attached, against transformers with prefix
# sharing alone and with its own CPU swap pool, in one run (issue 22); the CPU
# tests of the integration first (they need neither torch nor the GPU).
suite_tfcb() {
	if [ ! -f bench/transformers_cb.py ]; then
		echo "bench/transformers_cb.py does not exist at this commit" >>"$F"
		return 1
	fi
	# tfcb:STEP runs one time step of bench/tfcb_time.py (long, batch, atonce,
	# verify), each within one call; KVO_TFCB_PROFILE=1 adds a cProfile run.
	if [ -n "${1:-}" ]; then
		local prof=()
		[ "${KVO_TFCB_PROFILE:-0}" = 1 ] && prof=(--profile "$D")
		KVOFFLOAD_LIB=$B/libkvoffload.so PYTHONUNBUFFERED=1 PYTHONPATH=python \
			step timeout 560 python3 bench/transformers_cb.py --step "$1" --run-timeout 240 --out "$D" "${prof[@]}"
		return
	fi
	KVOFFLOAD_LIB=$B/libkvoffload.so PYTHONUNBUFFERED=1 \
		step_in python timeout 180 python3 -m unittest -v tests.test_tf_integration tests.test_tf_real tests.test_transformers_cb_bench
	KVOFFLOAD_LIB=$B/libkvoffload.so PYTHONUNBUFFERED=1 PYTHONPATH=python \
		step timeout 420 python3 bench/transformers_cb.py --budget "${KVO_TFCB_BUDGET:-300}" --out "$D" ${KVO_TFCB_ARGS:-}
	# KVO_TFCB_ARGS adds arguments (--models small, ...) and KVO_TFCB_EXAMPLE=0
	# leaves the example out (a call short of device time).
	[ "${KVO_TFCB_EXAMPLE:-1}" = 0 ] && return 0
	KVOFFLOAD_LIB=$B/libkvoffload.so PYTHONUNBUFFERED=1 PYTHONPATH=python \
		step timeout 120 python3 examples/transformers_cb.py
}

# The node pool (issue 25): `kvoffload serve` (KVOFFLOAD_BIN) and client
# processes (offload.test re-executed), each with its own CUDA context on
# the GPU; the table goes to nodepool/nodepool.md. About a minute.
suite_nodepool() {
	KVOFFLOAD_BIN=$B/kvoffload KVO_NODEGPU_FULL=1 KVO_BENCH_OUT=$D step_in offload timeout 280 "$B/offload.test" -test.v -test.count=1 \
		-test.run 'TestGPUNodePool$' -test.timeout 270s
}

# The lower tiers (issues 26, 27): the programs come from build/gpu-tools.tar.gz
# (make gpu-tools here; unpack_tools puts them on PATH). The disk suites write
# under $KVO_DISK_DIR (default build/tierbench in this checkout: the machine's own
# disk, not /tmp or /dev/shm, which may be tmpfs); the folder is removed after.
need_tools() {
	local p
	for p in fio redis-server redis-cli redis-benchmark; do
		if [ "$(command -v "$p")" != "$ROOT/build/gpu-tools/bin/$p" ]; then
			echo "$p is not build/gpu-tools/bin/$p: make gpu-tools here and carry build/gpu-tools.tar.gz" >>"$F"
			return 1
		fi
	done
	step cat "$ROOT/build/gpu-tools/VERSIONS"
}

# disk_facts DIR: where DIR is (file system, device) and whether it takes O_DIRECT.
disk_facts() {
	local dir=$1
	step df -T "$dir" /tmp /dev/shm "$ROOT"
	step findmnt -T "$dir"
	step lsblk -o NAME,SIZE,ROTA,TYPE,MODEL,MOUNTPOINTS
	# O_DIRECT: 256 MiB written, then read, bypassing the page cache (dd fails where it is refused).
	step dd if=/dev/zero of="$dir/odirect.probe" bs=2M count=128 oflag=direct,dsync
	step dd if="$dir/odirect.probe" of=/dev/null bs=2M iflag=direct
	rm -f "$dir/odirect.probe"
}

tier_dir() {
	TIER_DIR=${KVO_DISK_DIR:-$ROOT/build/tierbench}
	rm -rf "$TIER_DIR" && mkdir -p "$TIER_DIR"
}

suite_disk() {
	need_tools || return 1
	tier_dir
	disk_facts "$TIER_DIR"
	# What a payload's CRC-32C costs on this machine's CPUs, cold (as after a
	# DMA) and parallel (record.Checksum) against one core.
	step_in internal/tier/record timeout 60 "$B/internal_tier_record.test" -test.run '^$' -test.bench 'Checksum2MiB' -test.benchtime 300x -test.count 3
	KVO_DISK_BENCH=$TIER_DIR KVO_DISK_BENCH_MIB=${KVO_DISK_MIB:-2048} KVO_DISK_BENCH_ROUNDS=${KVO_DISK_ROUNDS:-3} KVO_BENCH_OUT=$D \
		step_in internal/tier/disk timeout 240 "$B/internal_tier_disk.test" -test.v -test.count=1 -test.run 'TestDiskVsFio$' -test.timeout 235s
	# Q=1 diagnosis (the log only): fio, plain preads and Get on one store's file, per record
	# time in preads and the rest, device reads a record, the buffers' physical layout.
	KVO_DISK_BENCH=$TIER_DIR KVO_DISK_BENCH_MIB=1024 KVO_DISK_BENCH_ROUNDS=3 KVO_DISK_BENCH_QS=1 KVO_DISK_BENCH_Q1DIAG=1 \
		step_in internal/tier/disk timeout 150 "$B/internal_tier_disk.test" -test.v -test.count=1 -test.run 'TestDiskVsFio$' -test.timeout 145s
	# The index scan at start (target: 2 s per 100,000 records) on this disk.
	TMPDIR=$TIER_DIR step_in internal/tier/disk timeout 150 "$B/internal_tier_disk.test" -test.run '^$' -test.bench 'OpenScan' \
		-test.benchtime 2x -test.count 1 -test.timeout 145s
	rm -rf "$TIER_DIR"
}

suite_cluster() {
	need_tools || return 1
	# Like for like with bench/results/cpu/cluster-vs-redis-benchmark.md (-c 6 -P 4,
	# 256 KiB and 2 MiB + 4 KiB records), then twice the connections at 256 KiB.
	KVO_CLUSTER_BENCH=1 KVO_CLUSTER_BENCH_ROUNDS=${KVO_CLUSTER_ROUNDS:-5} step_in internal/tier/cluster timeout 200 \
		"$B/internal_tier_cluster.test" -test.v -test.count=1 -test.run 'TestBenchVsRedisBenchmark$' -test.timeout 195s \
		-test.cpuprofile "$D/cluster-bench-cpu.pprof"
	# A reference the cluster bounds: redis-benchmark as 8 processes (its
	# rate: the requests over the span the masters took to serve them, from
	# their INFO commandstats) at 48 connections, depth 1, where its SETs and GETs keep the
	# three masters ~3 cores busy (the server CPU column says so per round;
	# at fewer processes or deeper pipelines its own client is the bound and
	# the tier beats it: an invalid reference). Then 12 connections, depth 4.
	# One size a step, each with a count that keeps a phase over a second.
	# Each step with a CPU profile of the test process (where a 2 MiB get's
	# time goes when neither the masters nor the client's CPUs are full).
	local size count
	for size in 262144:49152 2101248:6144; do
		count=${size#*:} size=${size%:*}
		KVO_CLUSTER_BENCH=1 KVO_CLUSTER_BENCH_ROUNDS=${KVO_CLUSTER_ROUNDS_BOUND:-5} KVO_CLUSTER_BENCH_PROCS=8 KVO_CLUSTER_BENCH_CONNS=48 KVO_CLUSTER_BENCH_DEPTH=1 \
			KVO_CLUSTER_BENCH_SIZES=$size KVO_CLUSTER_BENCH_COUNT=$count step_in internal/tier/cluster timeout 150 "$B/internal_tier_cluster.test" -test.v \
			-test.count=1 -test.run 'TestBenchVsRedisBenchmark$' -test.timeout 145s -test.cpuprofile "$D/cluster-bound-$size-cpu.pprof"
	done
	KVO_CLUSTER_BENCH=1 KVO_CLUSTER_BENCH_ROUNDS=3 KVO_CLUSTER_BENCH_CONNS=12 KVO_CLUSTER_BENCH_PROCS=4 KVO_CLUSTER_BENCH_SIZES=262144 \
		KVO_CLUSTER_BENCH_COUNT=24576 step_in internal/tier/cluster timeout 90 "$B/internal_tier_cluster.test" -test.v -test.count=1 \
		-test.run 'TestBenchVsRedisBenchmark$' -test.timeout 85s
}

# start_redis_cluster DIR PORT...: redis-server masters on loopback, one per port
# (its bus on port+10000), made a cluster; REDIS_PIDS are the processes.
start_redis_cluster() {
	local dir=$1 p addrs=() state
	shift
	REDIS_PIDS=()
	for p in "$@"; do
		redis-server --port "$p" --bind 127.0.0.1 --cluster-enabled yes --cluster-config-file "nodes-$p.conf" \
			--cluster-node-timeout 5000 --save '' --appendonly no --dir "$dir" --dbfilename "dump-$p.rdb" --logfile "$dir/redis-$p.log" &
		REDIS_PIDS+=($!)
		addrs+=("127.0.0.1:$p")
	done
	for p in "$@"; do
		for _ in $(seq 100); do
			[ "$(redis-cli -p "$p" ping 2>/dev/null)" = PONG ] && break
			sleep 0.1
		done
	done
	redis-cli --cluster create "${addrs[@]}" --cluster-replicas 0 --cluster-yes >"$dir/create.log" 2>&1 ||
		{ cat "$dir/create.log"; return 1; }
	for p in "$@"; do
		for _ in $(seq 200); do
			state=$(redis-cli -p "$p" cluster info 2>/dev/null | tr -d '\r' | sed -n 's/^cluster_state://p')
			[ "$state" = ok ] && break
			sleep 0.1
		done
		[ "$state" = ok ] || { echo "node $p: cluster_state $state"; return 1; }
	done
	echo "Redis Cluster up: ${addrs[*]} ($(redis-server --version | cut -d' ' -f1-3))"
}

stop_redis_cluster() {
	local pid
	for pid in "${REDIS_PIDS[@]}"; do kill "$pid" 2>/dev/null; done
	for pid in "${REDIS_PIDS[@]}"; do wait "$pid" 2>/dev/null; done
	REDIS_PIDS=()
}

suite_realtier() {
	if ! grep -q -- '--tier' bench/realmodel.py; then
		echo "bench/realmodel.py has no --tier at this commit" >>"$F"
		return 1
	fi
	need_tools || return 1
	tier_dir
	disk_facts "$TIER_DIR"
	local rdir=$TIER_DIR/redis ports tokens
	mkdir -p "$rdir"
	read -r -a ports <<<"${KVO_REDIS_PORTS:-17101 17102 17103}"
	read -r -a tokens <<<"${KVO_TIER_TOKENS:-2048 8192}"
	step start_redis_cluster "$rdir" "${ports[@]}"
	KVOFFLOAD_LIB=$B/libkvoffload.so PYTHONUNBUFFERED=1 PYTHONPATH=python \
		step timeout 280 python3 bench/realmodel.py --tokens "${tokens[@]}" --reps 3 \
		--tier "disk:$TIER_DIR" --tier "cluster:127.0.0.1:${ports[0]}" --out "$D/realmodel.md"
	step redis-cli -p "${ports[0]}" --cluster info "127.0.0.1:${ports[0]}"
	stop_redis_cluster
	rm -rf "$TIER_DIR"
}

suite_sweep() {
	local what=${1:-}
	case $what in
	parbatch) KVO_BENCH_PARBATCH=1 KVO_BENCH_OUT=$D step_in internal/benchgpu timeout 420 "$B/internal_benchgpu.test" -test.v -test.run 'TestParallelBatch$' -test.timeout 7m ;;
	mixed) KVO_BENCH_PARBATCH=1 KVO_BENCH_OUT=$D step_in internal/benchgpu timeout 420 "$B/internal_benchgpu.test" -test.v -test.run 'TestMixedBound$' -test.timeout 7m ;;
	staged) KVO_BENCH_PARBATCH=1 KVO_BENCH_OUT=$D step_in internal/benchgpu timeout 420 "$B/internal_benchgpu.test" -test.v -test.run 'TestStagedLoadProbe$' -test.timeout 7m ;;
	'') echo "sweep needs a name: sweep:bidir, sweep:parbatch, ... (--list)" >>"$F"; return 1 ;;
	*) KVO_BENCH_VARIANTS=$what KVO_BENCH_TOTAL_MIB=${KVO_BENCH_TOTAL_MIB:-2048} KVO_BENCH_OUT=$D \
		step_in internal/benchgpu timeout 540 "$B/internal_benchgpu.test" -test.v -test.run 'TestKernelVariants$' -test.timeout 9m ;;
	esac
}

# ---------------------------------------------------------------- machinery

# pkgdir internal_tier_disk → internal/tier/disk (the folder a test binary runs in).
pkgdir() {
	local d
	d=$(echo "$1" | tr _ /)
	[ -d "$d" ] || d=.
	echo "$d"
}

# step CMD... runs CMD with the suite's environment, appending "$ CMD" and its output
# to the result file $F; a failure makes the suite fail (STEP_RC).
step() {
	local rc
	{ echo; echo "\$ $(env_prefix)$(quote "$@")"; } >>"$F"
	"$@" >>"$F" 2>&1
	rc=$?
	echo "[exit $rc]" >>"$F"
	[ "$rc" -eq 0 ] || STEP_RC=$rc
	return 0
}

# step_in DIR CMD... is step with DIR as the working directory.
step_in() {
	local dir=$1 rc
	shift
	{ echo; echo "\$ (cd $dir && $(env_prefix "$dir")$(quote -C "$dir" "$@"))"; } >>"$F"
	(cd "$dir" && "$@") >>"$F" 2>&1
	rc=$?
	echo "[exit $rc]" >>"$F"
	[ "$rc" -eq 0 ] || STEP_RC=$rc
	return 0
}

# env_prefix [DIR] prints the KVO_/KVOFFLOAD_/PYTHONPATH/CUDA_ variables a step sees
# beyond the run's own (assignments written before `step` are exported to it).
env_prefix() {
	local v
	env | grep -E '^(KVO_|KVOFFLOAD_|PYTHONPATH=|CUDA_)' | grep -vxF -e "KVO_REQUIRE_GPU=1" | sort |
		while read -r v; do printf '%s ' "$(quote -C "${1:-.}" "$v")"; done
}

# quote [-C DIR] WORD... prints the words quoted for the shell, with paths in the
# repository relative to DIR (default: its root) and paths in the results relative
# to the results folder (h200/blocks).
quote() {
	local w out='' rel=''
	if [ "$1" = -C ]; then
		[ "$2" != . ] && rel=$(echo "$2" | sed 's|[^/][^/]*|..|g')/
		shift 2
	fi
	for w in "$@"; do
		w=${w//$WORK\//}
		w=${w//$ROOT\//$rel}
		case $w in
		*[!A-Za-z0-9_./:=,@%+-]*) out+="'${w//\'/\'\\\'\'}' " ;;
		*) out+="$w " ;;
		esac
	done
	echo "${out% }"
}

# unpack_tools replaces build/gpu-tools/ with make gpu-tools' archive, when there
# is one, and puts its programs first on PATH (their libraries only on theirs).
unpack_tools() {
	local a=$ROOT/build/gpu-tools.tar.gz
	if [ -f "$a" ]; then
		rm -rf "$ROOT/build/gpu-tools"
		tar -xzf "$a" -C "$ROOT/build" || { echo "cannot unpack $a" >&2; exit 2; }
	fi
	[ -d "$ROOT/build/gpu-tools/bin" ] && PATH=$ROOT/build/gpu-tools/bin:$PATH
}

# unpack replaces build/gpu/ with make gpu-bins' archive, when there is one (always:
# the carried file's time says nothing about which build it holds).
unpack() {
	if [ -f "$ARCHIVE" ]; then
		rm -rf "$B"
		mkdir -p "$ROOT/build"
		if ! tar -xzf "$ARCHIVE" -C "$ROOT/build"; then
			echo "cannot unpack $ARCHIVE" >&2
			exit 2
		fi
	fi
	if [ ! -f "$B/COMMIT" ]; then
		echo "no build/gpu/COMMIT: run make gpu-bins here and carry build/gpu.tar.gz" >&2
		exit 2
	fi
}

# machine_facts sets GPU_NAME, MACHINE (the results folder: h200) and MACHINE_LINE.
machine_facts() {
	local q gen width genmax widthmax mem cpu
	GPU_NAME=none DRIVER=none gen='?' width='?' genmax='?' widthmax='?' mem='?'
	if q=$(nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,pcie.link.width.max,memory.total \
		--format=csv,noheader 2>/dev/null | head -1) && [ -n "$q" ]; then
		IFS=, read -r GPU_NAME DRIVER gen width genmax widthmax mem <<<"$q"
		GPU_NAME=$(echo "$GPU_NAME" | xargs) DRIVER=$(echo "$DRIVER" | xargs)
		gen=$(echo "$gen" | xargs) width=$(echo "$width" | xargs) genmax=$(echo "$genmax" | xargs)
		widthmax=$(echo "$widthmax" | xargs) mem=$(echo "$mem" | xargs)
	fi
	MACHINE=${KVO_MACHINE:-$(echo "$GPU_NAME" | sed -E 's/^NVIDIA //I' | tr '[:upper:]' '[:lower:]' | sed -E 's/[^a-z0-9]+/-/g; s/^-+|-+$//g')}
	[ "$GPU_NAME" = none ] && MACHINE=${KVO_MACHINE:-nogpu}
	cpu=$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | xargs)
	MACHINE_LINE="$GPU_NAME ($mem), driver $DRIVER, PCIe Gen$gen x$width now (max Gen$genmax x$widthmax); $(nproc) CPUs ($cpu); $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo) memory; $(uname -r)"
}

# counts FILE prints "pass fail skip" from go test -v and unittest output.
counts() {
	local f=$1 pass fail skip ran uf ue us
	pass=$(grep -cE '^--- PASS' "$f")
	fail=$(grep -cE '^--- FAIL|^panic:' "$f")
	skip=$(grep -cE '^--- SKIP' "$f")
	# unittest: "Ran N tests", then "OK", "OK (skipped=K)" or "FAILED (failures=a, errors=b, skipped=c)".
	ran=$(grep -E '^Ran [0-9]+ tests?' "$f" | awk '{s += $2} END {print s + 0}')
	uf=$(grep -oE '(failures|errors)=[0-9]+' "$f" | cut -d= -f2 | awk '{s += $1} END {print s + 0}')
	us=$(grep -oE 'skipped=[0-9]+' "$f" | cut -d= -f2 | awk '{s += $1} END {print s + 0}')
	ue=$((uf + us))
	echo "$((pass + ran - ue)) $((fail + uf)) $((skip + us))"
}

run_suite() {
	local spec=$1 fn arg name start secs rc p f s
	fn=${spec%%:*} arg=
	[ "$fn" != "$spec" ] && arg=${spec#*:}
	name=$fn${arg:+-$arg}
	D=$WORK/$MACHINE/$name F=$WORK/$MACHINE/$name.txt STEP_RC=0
	rm -rf "$D" "$F" && mkdir -p "$D"
	{
		echo "# kvoffload GPU suite: $name"
		echo "command: bash scripts/gpu/run.sh $CMDLINE"
		echo "suite:   $name (suite_$fn in scripts/gpu/run.sh${arg:+, argument $arg})"
		echo "commit:  $COMMIT"
		echo "date:    $(date -u +%FT%TZ)"
		echo "machine: $MACHINE_LINE"
		echo "env:     KVO_REQUIRE_GPU=1 (below, $MACHINE/$name is the folder beside this file)"
	} >"$F"
	echo "== $name"
	start=$(date +%s)
	if declare -F "suite_$fn" >/dev/null; then
		if ! "suite_$fn" ${arg:+"$arg"} && [ "$STEP_RC" -eq 0 ]; then STEP_RC=1; fi
	else
		echo "no suite $fn (bash scripts/gpu/run.sh --list)" >>"$F"
		STEP_RC=2
	fi
	secs=$(($(date +%s) - start))
	rc=$STEP_RC
	read -r p f s <<<"$(counts "$F")"
	[ "$rc" -eq 0 ] && [ "$f" -gt 0 ] && rc=1
	[ "$rc" -eq 0 ] && [ "$s" -gt 0 ] && rc=1 # KVO_REQUIRE_GPU=1: a skip is a failure
	rmdir "$D" 2>/dev/null
	printf '\n== %s: %s (rc %s, %s passed, %s failed, %s skipped, %ss)\n' "$name" \
		"$([ "$rc" -eq 0 ] && echo PASS || echo FAIL)" "$rc" "$p" "$f" "$s" "$secs" >>"$F"
	ROWS+=("$(printf '%-16s %-4s rc=%-3s pass=%-4s fail=%-4s skip=%-4s %5ss' "$name" \
		"$([ "$rc" -eq 0 ] && echo ok || echo FAIL)" "$rc" "$p" "$f" "$s" "$secs")")
	[ "$rc" -eq 0 ] || { FAILED=1; grep -E '^(--- FAIL|panic:|FAIL|FAILED|ERROR:|Traceback)|\[exit [1-9]' "$F" | head -20; }
	pack
}

# pack writes what has finished to $OUT: results.tar.gz and summary.txt.
pack() {
	{
		echo "bash scripts/gpu/run.sh $CMDLINE"
		echo "commit $COMMIT; $MACHINE_LINE"
		echo
		printf '%s\n' "${ROWS[@]}"
	} >"$OUT/summary.txt"
	tar -czf "$OUT/results.tar.gz" -C "$WORK" "$MACHINE"
}

collect() {
	local from=$1 tmp m f name
	[ -d "$from" ] && from=$from/results.tar.gz
	[ -f "$from" ] || { echo "no $from" >&2; exit 2; }
	tmp=$(mktemp -d)
	tar -xzf "$from" -C "$tmp" || exit 2
	for m in "$tmp"/*/; do
		m=$(basename "$m")
		mkdir -p "bench/results/$m"
		for f in "$tmp/$m"/*.txt; do
			name=$(basename "$f" .txt)
			rm -rf "bench/results/$m/$name" "bench/results/$m/$name.txt"
			cp "$f" "bench/results/$m/"
			[ -d "$tmp/$m/$name" ] && cp -r "$tmp/$m/$name" "bench/results/$m/"
			echo "bench/results/$m/$name.txt: $(sed -n 's/^== .*: \(PASS\|FAIL\) .*/\1/p' "$f" | tail -1), $(grep -m1 '^commit:' "$f"), $(grep -m1 '^date:' "$f")"
		done
	done
	rm -rf "$tmp"
	echo "now update bench/results/README.md's table (figure, file, command, commit, date)"
}

list() {
	local s
	for s in "${SUITES[@]}"; do printf '%-12s %s\n' "${s%%|*}" "${s#*|}"; done
	printf '%-12s %s\n' all "${ALL_SUITES[*]}"
}

main() {
	case ${1:-} in
	'' | -h | --help) sed -n '3,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2 ;;
	--list | suites) list; exit 0 ;;
	--collect) collect "${2:?--collect FROM}"; exit 0 ;;
	esac
	CMDLINE="$*"
	local specs=() s
	for s in "$@"; do
		if [ "$s" = all ]; then specs+=("${ALL_SUITES[@]}"); else specs+=("$s"); fi
	done
	local only_wheel=1
	for s in "${specs[@]}"; do [ "$s" = wheel ] || only_wheel=0; done
	if [ "$only_wheel" = 1 ] && [ ! -f "$ARCHIVE" ] && [ ! -f "$B/COMMIT" ]; then
		# Only the wheel suite and no make gpu-bins archive: the wheel is what is tested.
		COMMIT="$(cd dist 2>/dev/null && echo kvoffload-*.whl) (the wheel from make wheel)"
	else
		unpack
		COMMIT="$(cat "$B/COMMIT") (binaries from make gpu-bins)"
	fi
	unpack_tools
	machine_facts
	mkdir -p "$OUT"
	WORK=$(mktemp -d)
	export KVO_REQUIRE_GPU=1
	ROWS=() FAILED=0
	echo "commit $COMMIT; $MACHINE_LINE"
	for s in "${specs[@]}"; do run_suite "$s"; done
	rm -rf "$WORK"
	echo
	echo "== summary: bash scripts/gpu/run.sh $CMDLINE (results in $OUT/results.tar.gz)"
	printf '%s\n' "${ROWS[@]}"
	exit "$FAILED"
}

main "$@"
