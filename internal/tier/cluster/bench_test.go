package cluster

import (
	"bufio"
	"bytes"
	"context"
	"encoding/csv"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/rueidis"
	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/tier/record"
)

// TestBenchVsRedisBenchmark compares the tier with redis-benchmark like for
// like: one cluster (3 masters), one run, records of the same size (the
// tier's header included: redis-benchmark's -d is the tier's header plus
// payload), the same number of requests outstanding (connections × pipeline
// depth), the same count and a keyspace of the same size spread as evenly
// over the masters (balancedKeys). redis-benchmark's rate is what the
// masters served (callsWatch); each phase's log line says how its calls and
// the masters' CPU were shared among the masters. Not in CI: it runs with
// KVO_CLUSTER_BENCH=1. KVO_CLUSTER_BENCH_SIZES (record bytes, comma-separated), _CONNS, _DEPTH
// _COUNT and _ROUNDS (redis-benchmark and the tier alternate that many
// times, default 3) change the defaults.
func TestBenchVsRedisBenchmark(t *testing.T) {
	if os.Getenv("KVO_CLUSTER_BENCH") != "1" {
		t.Skip("set KVO_CLUSTER_BENCH=1 to run the benchmark against redis-benchmark")
	}
	needRedis(t)
	if _, err := exec.LookPath("redis-benchmark"); err != nil {
		t.Skip("redis-benchmark not found")
	}
	env := func(name string, def int) int {
		if v, err := strconv.Atoi(os.Getenv(name)); err == nil {
			return v
		}
		return def
	}
	sizes := []int{256 << 10, 2<<20 + 4<<10}
	if v := os.Getenv("KVO_CLUSTER_BENCH_SIZES"); v != "" {
		sizes = nil
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.Atoi(f)
			if err != nil || n <= record.HeaderSize {
				t.Fatalf("bad size %q", f)
			}
			sizes = append(sizes, n)
		}
	}
	conns, depth := env("KVO_CLUSTER_BENCH_CONNS", 6), env("KVO_CLUSTER_BENCH_DEPTH", 4)
	// redis-benchmark --threads (0: not given, its one event loop): a
	// reference the tier outruns is its client's bound, not the cluster's.
	rbThreads = env("KVO_CLUSTER_BENCH_THREADS", 0)
	rbProcs = env("KVO_CLUSTER_BENCH_PROCS", 1)
	// The puts' copy on at most this many goroutines each (0: CopyChecksum's
	// own; -1: half the cores shared out among the puts in flight).
	if w := env("KVO_CLUSTER_BENCH_COPYWAYS", 0); w != 0 {
		saved := ioBuffers
		defer func() { ioBuffers = saved }()
		ioBuffers.copyWays = w
		fmt.Printf("\nthe puts' copy: copyWays %d\n", w)
	}
	keyspace := 96
	c := newCluster(t, 3, 0, "")
	perNode := 1
	for perNode*3 < conns {
		perNode *= 2
	}
	fmt.Printf("\ncluster: 3 masters on loopback; %d connections, pipeline depth %d (the tier: %d connections per master, %d requests outstanding); keyspace %d\n\n",
		conns, depth, perNode, conns*depth, keyspace)
	rounds := env("KVO_CLUSTER_BENCH_ROUNDS", 3)
	fmt.Printf("%d rounds, each redis-benchmark then the tier, alternating; the median row is the median of the rounds' ratios\n\n", rounds)
	if rbThreads > 0 {
		fmt.Printf("redis-benchmark runs with --threads %d\n\n", rbThreads)
	}
	if rbProcs > 1 {
		fmt.Printf("redis-benchmark runs as %d processes at once (connections and requests shared out, seed nodes in turn), their rates summed\n\n", rbProcsFor(conns, 3))
	}
	fmt.Println("client CPU: the client process's user+system time per request (redis-benchmark's from its rusage, run once per op; the tier's from the test process's, over the op's phase)")
	fmt.Println()
	fmt.Println("server CPU: the masters' user+system time together (from /proc/PID/stat, 10 ms ticks) per request over the same phase, and as cores busy on average (3 masters: 3 cores at most, one event loop each)")
	fmt.Println()
	fmt.Println("| record bytes | op | round | load avg | count | redis-benchmark req/s | tier req/s | tier / redis-benchmark | tier GB/s | client CPU µs/req: redis-benchmark, tier | server CPU µs/req (cores): redis-benchmark, tier |")
	fmt.Println("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
	var invalid []string
	flush := func() {
		for _, p := range c.ports[:3] {
			c.cli(p, "flushall")
		}
	}
	for _, size := range sizes {
		count := env("KVO_CLUSTER_BENCH_COUNT", max(200, int((2<<30)/int64(size))))
		ratios := map[string][]float64{}
		for round := range rounds {
			load := loadAvg()
			srv0 := c.serverCPU()
			rbSet, rbSetCPU := redisBenchmark(t, c, "set", size, depth, conns, count, keyspace)
			srv1 := c.serverCPU()
			rbGet, rbGetCPU := redisBenchmark(t, c, "get", size, depth, conns, count, keyspace)
			rbSetSrv, rbGetSrv := srv1-srv0, c.serverCPU()-srv1
			flush()
			tr := benchTier(t, c, size, depth, conns, count, keyspace, perNode)
			flush()
			for _, r := range []struct {
				op             string
				rb, tier       float64
				rbCPU, tierCPU time.Duration
				rbSrv, tierSrv time.Duration
			}{{"SET / PutAsync", rbSet, tr.put, rbSetCPU, tr.putCPU, rbSetSrv, tr.putSrv},
				{"SET / PutAsyncFrom", rbSet, tr.putFrom, rbSetCPU, tr.putFromCPU, rbSetSrv, tr.putFromSrv}, {"GET / Get", rbGet, tr.get, rbGetCPU, tr.getCPU, rbGetSrv, tr.getSrv},
				{"GET / GetDirect", rbGet, tr.getDirect, rbGetCPU, tr.getDirectCPU, rbGetSrv, tr.getDirectSrv},
				{"GET / GetDirect, pinned", rbGet, tr.pinned, rbGetCPU, tr.pinnedCPU, rbGetSrv, tr.pinnedSrv},
				{"GET / GetDirect, keyspace calls", rbGet, tr.calls, rbGetCPU, tr.callsCPU, rbGetSrv, tr.callsSrv},
				{"GET / GetDirect, keyspace calls, key order", rbGet, tr.callsOrder, rbGetCPU, tr.callsOrderCPU, rbGetSrv, tr.callsOrderSrv},
				{"SET / the client alone", rbSet, tr.raw, rbSetCPU, tr.rawCPU, rbSetSrv, tr.rawSrv},
				{"GET / the client alone", rbGet, tr.rawGet, rbGetCPU, tr.rawGetCPU, rbGetSrv, tr.rawGetSrv}} {
				ratios[r.op] = append(ratios[r.op], r.tier/r.rb)
				if strings.HasPrefix(r.op, "GET / GetDirect") {
					ratios[r.op+" ÷ the client alone"] = append(ratios[r.op+" ÷ the client alone"], r.tier/tr.rawGet)
				}
				fmt.Printf("| %d | %s | %d | %s | %d | %.0f | %.0f | %.0f%% | %.2f | %.0f, %.0f | %.0f (%.1f), %.0f (%.1f) |\n", size, r.op, round+1, load, count, r.rb, r.tier,
					100*r.tier/r.rb, r.tier*float64(size)/1e9, us(r.rbCPU, count), us(r.tierCPU, count),
					us(r.rbSrv, count), us(r.rbSrv, count)*r.rb/1e6, us(r.tierSrv, count), us(r.tierSrv, count)*r.tier/1e6)
			}
		}
		for _, op := range []string{"SET / PutAsync", "SET / PutAsyncFrom", "GET / Get", "GET / GetDirect", "GET / GetDirect, pinned", "GET / GetDirect, keyspace calls", "GET / GetDirect, keyspace calls, key order", "SET / the client alone", "GET / the client alone",
			"GET / GetDirect ÷ the client alone", "GET / GetDirect, keyspace calls ÷ the client alone"} {
			rs := append([]float64(nil), ratios[op]...)
			sort.Float64s(rs)
			fmt.Printf("| %d | %s | **median** | | | | | **%.0f%%** | | |\n", size, op, 100*rs[len(rs)/2])
			if rs[len(rs)/2] > 1.02 {
				ref := "redis-benchmark"
				if strings.HasSuffix(op, " ÷ the client alone") {
					ref = "the client alone"
				}
				invalid = append(invalid, fmt.Sprintf("%d-byte %s: the tier at %.0f%% of %s", size, op, 100*rs[len(rs)/2], ref))
			}
		}
	}
	fmt.Println()
	if len(invalid) > 0 {
		fmt.Printf("INVALID as a check of the target (the tier beats its reference by more than 2%%: the reference's client, not the cluster, is the bound; no target is claimed on these rows): %s\n\n", strings.Join(invalid, "; "))
	}
}

// loadAvg is the machine's 1-minute load average (other processes share its
// cores: the rounds say how busy it was).
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return "?"
	}
	return f[0]
}

// us is d per request in microseconds.
func us(d time.Duration, n int) float64 { return float64(d.Microseconds()) / float64(n) }

// cpuTime is the user+system time of this process (who = RUSAGE_SELF) or of
// its waited-for children (RUSAGE_CHILDREN).
func cpuTime(who int) time.Duration {
	var r syscall.Rusage
	if err := syscall.Getrusage(who, &r); err != nil {
		return 0
	}
	return time.Duration(r.Utime.Nano() + r.Stime.Nano())
}

// rbThreads is redis-benchmark's --threads (KVO_CLUSTER_BENCH_THREADS);
// rbProcs how many redis-benchmark processes run at once, sharing the
// connections and requests, their rates summed (KVO_CLUSTER_BENCH_PROCS,
// default 1): a reference that one client process does not bound.
var rbThreads, rbProcs int

// rbProcsFor is how many redis-benchmark processes share conns
// connections to a cluster of masters masters: rbProcs, but no more than
// leaves each process a connection per master (redis-benchmark --cluster
// exits 1 with fewer clients than nodes), and at least one.
func rbProcsFor(conns, masters int) int {
	return max(1, min(rbProcs, conns/max(1, masters)))
}

// redisBenchmark runs redis-benchmark --cluster -t test and returns its
// requests per second and its CPU time.
func redisBenchmark(t *testing.T, c *testCluster, test string, size, depth, conns, count, keyspace int) (float64, time.Duration) {
	// redis-benchmark --cluster needs at least as many connections as the
	// cluster has masters: each process gets at least that many.
	procs := rbProcsFor(conns, 3)
	argsOf := func(k int) []string {
		// Process k of procs: its share of the connections and requests.
		kc, kn := conns/procs, count/procs
		if k < conns%procs {
			kc++
		}
		if k < count%procs {
			kn++
		}
		args := []string{"--cluster", "-h", "127.0.0.1", "-p", strconv.Itoa(c.ports[k%3]), "-t", test,
			"-d", strconv.Itoa(size), "-P", strconv.Itoa(depth), "-c", strconv.Itoa(kc),
			"-n", strconv.Itoa(kn), "-r", strconv.Itoa(keyspace), "--csv"}
		if rbThreads > 0 {
			args = append(args, "--threads", strconv.Itoa(rbThreads))
		}
		return args
	}
	// The reference's rate is what the masters served: redis-benchmark in
	// cluster mode runs threads, and with threads its run ends only at its
	// 250 ms throughput timer, so its own elapsed time is rounded up to a
	// multiple of 250 ms (a 0.6 s run reported as 0.75 s: its rate 20%
	// low). Its own rates, summed, are printed beside for the record.
	w, err := newCallsWatch(c.ports[:3], test)
	if err != nil {
		t.Fatal(err)
	}
	defer w.close()
	split := mastersSplit(c, test)
	watched := make(chan callsSpan, 1)
	go func() { watched <- w.wait(int64(count), 5*time.Minute) }()
	cpu0 := cpuTime(syscall.RUSAGE_CHILDREN)
	outs := make([][]byte, procs)
	errs := make([]error, procs)
	var wg sync.WaitGroup
	for k := range procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			outs[k], errs[k] = exec.Command("redis-benchmark", argsOf(k)...).Output()
		}()
	}
	wg.Wait()
	cpu := cpuTime(syscall.RUSAGE_CHILDREN) - cpu0
	total := 0.0
	for k := range procs {
		args := argsOf(k)
		if errs[k] != nil {
			t.Fatalf("redis-benchmark %v: %v\n%s", args, errs[k], outs[k])
		}
		fmt.Printf("<!-- redis-benchmark %s -->\n", strings.Join(args, " "))
		total += rbRate(t, test, outs[k])
	}
	span := <-watched
	if span.err != nil {
		t.Fatalf("redis-benchmark %s: the masters' %s calls: %v", test, test, span.err)
	}
	rate := float64(count) / span.end.Sub(span.start).Seconds()
	fmt.Printf("<!-- redis-benchmark %s: %d requests served in %v by the masters' count (%.0f/s); its own rates summed: %.0f/s; %s -->\n",
		test, count, span.end.Sub(span.start).Round(time.Millisecond), rate, total, split(span.end.Sub(span.start)))
	return rate, cpu
}

// callsWatch reads how many times the masters have run a command (INFO
// commandstats, summed over the masters), over plain connections of its
// own.
type callsWatch struct {
	cmd   string
	conns []net.Conn
	rds   []*bufio.Reader
	base  int64
}

// callsSpan is when the masters' count of a command first rose above its
// base and when it reached base plus the requests asked for, each the
// midpoint of the two polls around it (polls 2 ms apart, each of a few
// hundred µs under load: a span's error is a few ms).
type callsSpan struct {
	start, end time.Time
	err        error
}

func newCallsWatch(ports []int, cmd string) (*callsWatch, error) {
	w := &callsWatch{cmd: cmd}
	for _, p := range ports {
		conn, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(p), 5*time.Second)
		if err != nil {
			w.close()
			return nil, err
		}
		w.conns = append(w.conns, conn)
		w.rds = append(w.rds, bufio.NewReader(conn))
	}
	base, err := w.calls()
	if err != nil {
		w.close()
		return nil, err
	}
	w.base = base
	return w, nil
}

func (w *callsWatch) close() {
	for _, c := range w.conns {
		c.Close()
	}
}

// calls is the masters' count of w.cmd calls now.
func (w *callsWatch) calls() (int64, error) {
	each, err := w.callsEach()
	var total int64
	for _, n := range each {
		total += n
	}
	return total, err
}

// callsEach is each master's count of w.cmd calls now.
func (w *callsWatch) callsEach() ([]int64, error) {
	each := make([]int64, len(w.conns))
	for i, c := range w.conns {
		c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := c.Write([]byte("*2\r\n$4\r\nINFO\r\n$12\r\ncommandstats\r\n")); err != nil {
			return nil, err
		}
		n, err := parseCalls(w.rds[i], w.cmd)
		if err != nil {
			return nil, err
		}
		each[i] = n
	}
	return each, nil
}

// parseCalls reads one INFO reply (a bulk string) from r and returns the
// calls of cmd in it (0 when cmd has not run).
func parseCalls(r *bufio.Reader, cmd string) (int64, error) {
	line, err := r.ReadString('\n')
	if err != nil {
		return 0, err
	}
	if !strings.HasPrefix(line, "$") {
		return 0, fmt.Errorf("INFO replied %q", strings.TrimSpace(line))
	}
	n, err := strconv.Atoi(strings.TrimSpace(line[1:]))
	if err != nil || n < 0 || n > 1<<20 {
		return 0, fmt.Errorf("INFO reply length %q", strings.TrimSpace(line))
	}
	body := make([]byte, n+2)
	if _, err := io.ReadFull(r, body); err != nil {
		return 0, err
	}
	field := "cmdstat_" + cmd + ":calls="
	i := bytes.Index(body, []byte(field))
	if i < 0 {
		return 0, nil
	}
	v := body[i+len(field):]
	if j := bytes.IndexByte(v, ','); j >= 0 {
		v = v[:j]
	}
	return strconv.ParseInt(string(v), 10, 64)
}

// wait polls until the masters have run n calls beyond the base, or for
// at most d, and returns the span they took.
func (w *callsWatch) wait(n int64, d time.Duration) callsSpan {
	deadline := time.Now().Add(d)
	prev := time.Now()
	var span callsSpan
	started := false
	var got int64
	for time.Now().Before(deadline) {
		at := time.Now()
		var err error
		got, err = w.calls()
		if err != nil {
			return callsSpan{err: err}
		}
		mid := prev.Add(at.Sub(prev) / 2)
		if !started && got > w.base {
			span.start, started = mid, true
		}
		if got >= w.base+n {
			span.end = mid
			return span
		}
		prev = at
		time.Sleep(2 * time.Millisecond)
	}
	return callsSpan{err: fmt.Errorf("%d of %d calls in %v", got-w.base, n, d)}
}

// rbRate is the requests per second of test in redis-benchmark's CSV out.
func rbRate(t *testing.T, test string, out []byte) float64 {
	var lines []string // the CSV rows, after the cluster's description
	for _, l := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(l, `"`) {
			lines = append(lines, l)
		}
	}
	rows, err := csv.NewReader(strings.NewReader(strings.Join(lines, "\n"))).ReadAll()
	if err != nil {
		t.Fatalf("redis-benchmark output: %v\n%s", err, out)
	}
	for _, r := range rows {
		if len(r) >= 2 && strings.EqualFold(r[0], test) {
			if v, err := strconv.ParseFloat(r[1], 64); err == nil {
				return v
			}
		}
	}
	t.Fatalf("redis-benchmark output has no %s row:\n%s", test, out)
	return 0
}

// benchTier puts count records of size bytes (keyspace distinct keys) with
// conns×depth puts outstanding, then gets count records with conns
// goroutines each asking for depth keys a call (with Get, then again with
// GetDirect), then has the Redis client SET count records by itself (no
// copy, no checksum); it returns the rates and the process's CPU time in
// each phase. The store may have conns×depth puts in flight and as many
// streamed GETs (Config.Streams: its default, 32, held a 48-connection
// run's gets to 32 outstanding, where redis-benchmark had 48).
func benchTier(t *testing.T, c *testCluster, size, depth, conns, count, keyspace, perNode int) tierResult {
	outstanding := conns * depth
	sem := make(chan struct{}, outstanding)
	s, err := Open(context.Background(), Config{Addrs: c.addrs(), Namespace: "bench", Fingerprint: 1,
		MaxInFlightBytes: int64(outstanding * size), Streams: outstanding, ConnsPerNode: perNode, Timeout: 10 * time.Second,
		OnPutDone: func([16]byte, bool) { <-sem }})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	payload := make([]byte, size-record.HeaderSize)
	for i := range payload {
		payload[i] = byte(i * 7)
	}
	// The keys, as many a master: redis-benchmark --cluster pins each of its
	// connections to one master's slots, so its keyspace is spread evenly by
	// construction, where 96 hashed keys fall unevenly (36/28/36% on the
	// 2-CPU VM's cluster) and the busiest master bounds the tier; an
	// engine's thousands of blocks spread as evenly as the hash does.
	keys := balancedKeys(s.key, s.gen.Load(), keyspace, c.masters, 0xbe)
	var r tierResult
	// The puts: one goroutine putting (as the engine's store completion
	// does), conns×depth in flight; with PutAsync (copied on the caller)
	// or PutAsyncFrom (copied on the put's goroutine: the engine's
	// write-through; the payload never changes, so release does nothing).
	puts := func(name string, put func(k [16]byte) bool) (float64, time.Duration, time.Duration) {
		split := mastersSplit(c, "set")
		cpu0, srv0 := cpuTime(syscall.RUSAGE_SELF), c.serverCPU()
		start := time.Now()
		for i := range count {
			sem <- struct{}{}
			if !put(keys[i%keyspace]) {
				t.Fatal("put dropped")
			}
		}
		s.Flush()
		elapsed := time.Since(start)
		rate := float64(count) / elapsed.Seconds()
		fmt.Printf("<!-- the tier's %s: %s -->\n", name, split(elapsed))
		if st := s.Stats(); st.PutErrors != 0 {
			t.Fatalf("put errors: %+v", st)
		}
		return rate, cpuTime(syscall.RUSAGE_SELF) - cpu0, c.serverCPU() - srv0
	}
	r.put, r.putCPU, r.putSrv = puts("PutAsync", func(k [16]byte) bool { return s.PutAsync(k, payload) })
	r.putFrom, r.putFromCPU, r.putFromSrv = puts("PutAsyncFrom", func(k [16]byte) bool { return s.PutAsyncFrom(k, payload, func() {}) })

	var hits atomic.Int64
	// The keys each master serves, by the store's slot map.
	sm := s.slots.Load()
	if sm == nil || len(sm.addrs) != c.masters {
		t.Fatalf("the store has no slot map of %d masters", c.masters)
	}
	byMaster := make([][][16]byte, c.masters)
	for _, k := range keys {
		m := int(sm.owner[keySlot(s.key(s.gen.Load(), k))])
		byMaster[m] = append(byMaster[m], k)
	}
	// How the gets are driven: workers goroutines, each asking for up to
	// per keys a call, keyOf(w, i) the key of the worker w's i-th request.
	type driver struct {
		workers, per int
		keyOf        func(w, i int) [16]byte
	}
	// spread: conns goroutines, depth keys a call, every key in turn from
	// every worker (each request to any master).
	spread := driver{conns, depth, func(w, i int) [16]byte { return keys[(i+w)%keyspace] }}
	// pinned: conns goroutines, depth keys a call, a worker's keys all on
	// one master, conns/masters workers a master: redis-benchmark
	// --cluster's connections, each of which sends only keys of its node.
	pinned := driver{conns, depth, func(w, i int) [16]byte {
		ks := byMaster[w%c.masters]
		return ks[i%len(ks)]
	}}
	// calls: two goroutines each asking for the whole keyspace a call, the
	// store's Streams (conns×depth) bounding the GETs in flight: the
	// engine's Prefetch of a long prefix.
	calls := driver{2, keyspace, func(_, i int) [16]byte { return keys[i%keyspace] }}
	// The Gets, with get (Get, or GetDirect, the engine's promotion path).
	gets := func(name string, d driver, get func(context.Context, [][16]byte, [][]byte) []bool) (float64, time.Duration, time.Duration) {
		hits.Store(0)
		split := mastersSplit(c, "get")
		// Each streamed GET's wait for its reply's first byte (the master's
		// queue and its turn to write) and the reply's transfer, apart.
		var tmu sync.Mutex
		var queued, moved []time.Duration
		streamTimes = func(sent, first, done time.Time) {
			tmu.Lock()
			queued, moved = append(queued, first.Sub(sent)), append(moved, done.Sub(first))
			tmu.Unlock()
		}
		defer func() { streamTimes = nil }()
		// The destinations, written once before the clock starts (as the
		// engine's pool slots are): a fresh page's fault is not the tier's.
		dsts := make([][][]byte, d.workers)
		for w := range dsts {
			dsts[w] = dstsN(d.per, size-record.HeaderSize)
			for _, b := range dsts[w] {
				for j := 0; j < len(b); j += 4096 {
					b[j] = 1
				}
			}
		}
		cpu0, srv0 := cpuTime(syscall.RUSAGE_SELF), c.serverCPU()
		start := time.Now()
		inBatches(d.workers, d.per, count, func(w int) func(i, n int) bool {
			ks := make([][16]byte, d.per)
			ds := dsts[w]
			return func(i, n int) bool {
				for j := range n {
					ks[j] = d.keyOf(w, i+j)
				}
				hits.Add(int64(count1(get(context.Background(), ks[:n], ds[:n]))))
				return true
			}
		})
		elapsed := time.Since(start)
		rate, cpu, srv := float64(count)/elapsed.Seconds(), cpuTime(syscall.RUSAGE_SELF)-cpu0, c.serverCPU()-srv0
		streamTimes = nil
		fmt.Printf("<!-- the tier's %s: %s; %s -->\n", name, split(elapsed), quantiles(queued, moved))
		if hits.Load() != int64(count) {
			t.Fatalf("%d hits of %d: %+v", hits.Load(), count, s.Stats())
		}
		return rate, cpu, srv
	}
	r.get, r.getCPU, r.getSrv = gets("Get", spread, s.Get)
	r.getDirect, r.getDirectCPU, r.getDirectSrv = gets("GetDirect", spread, s.GetDirect)
	r.pinned, r.pinnedCPU, r.pinnedSrv = gets("GetDirect pinned", pinned, s.GetDirect)
	r.calls, r.callsCPU, r.callsSrv = gets("GetDirect of the keyspace a call", calls, s.GetDirect)
	func() {
		saved := ioBuffers.perMaster
		defer func() { ioBuffers.perMaster = saved }()
		ioBuffers.perMaster = false
		r.callsOrder, r.callsOrderCPU, r.callsOrderSrv = gets("GetDirect of the keyspace a call, streams in key order", calls, s.GetDirect)
	}()

	// The client alone: the same SETs (a whole record each, from one
	// buffer: no copy, no checksum) as conns goroutines sending depth at a
	// time with DoMulti, as redis-benchmark -c conns -P depth does.
	client := s.cl()
	rec := make([]byte, size)
	rkeys := make([]string, keyspace)
	for i, k := range balancedKeys(s.key, 1<<40, keyspace, c.masters, 0xbf) {
		rkeys[i] = s.key(1<<40, k)
	}
	split := mastersSplit(c, "set")
	cpu0, srv0 := cpuTime(syscall.RUSAGE_SELF), c.serverCPU()
	start := time.Now()
	inBatches(conns, depth, count, func(int) func(i, n int) bool {
		cmds := make(rueidis.Commands, depth)
		return func(i, n int) bool {
			for j := range n {
				cmds[j] = client.B().Set().Key(rkeys[(i+j)%keyspace]).Value(rueidis.BinaryString(rec)).Px(time.Minute).Build()
			}
			for _, res := range client.DoMulti(context.Background(), cmds[:n]...) {
				if err := res.Error(); err != nil {
					t.Errorf("SET: %v", err)
					return false
				}
			}
			return true
		}
	})
	elapsed := time.Since(start)
	r.raw = float64(count) / elapsed.Seconds()
	fmt.Printf("<!-- the Go client alone: %s -->\n", split(elapsed))
	r.rawCPU, r.rawSrv = cpuTime(syscall.RUSAGE_SELF)-cpu0, c.serverCPU()-srv0

	// The client alone, reading them back: conns×depth workers (the
	// requests redis-benchmark keeps outstanding), each worker's keys on one
	// master as redis-benchmark --cluster's connections' are, each reply
	// streamed (DoStream, as GetDirect's) into a buffer: no allocation, no
	// check, no copy. The tier's ceiling on this client, a reference for
	// GetDirect that redis-benchmark's own client (which costs the masters
	// more CPU per reply) is not.
	rawByMaster := make([][]string, c.masters)
	for _, rk := range rkeys {
		m := int(sm.owner[keySlot(rk)])
		rawByMaster[m] = append(rawByMaster[m], rk)
	}
	split = mastersSplit(c, "get")
	bufs := make([]sinkBuf, conns*depth)
	for w := range bufs {
		bufs[w].b = make([]byte, size)
		for j := 0; j < size; j += 4096 {
			bufs[w].b[j] = 1
		}
	}
	cpu0, srv0 = cpuTime(syscall.RUSAGE_SELF), c.serverCPU()
	start = time.Now()
	inBatches(conns*depth, 1, count, func(w int) func(i, n int) bool {
		ks := rawByMaster[w%c.masters]
		return func(i, _ int) bool {
			bufs[w].n, bufs[w].over = 0, 0
			st := client.DoStream(context.Background(), client.B().Get().Key(ks[i%len(ks)]).Build())
			_, err := st.WriteTo(&bufs[w])
			if err != nil || bufs[w].n != size || bufs[w].over != 0 {
				t.Errorf("GET: %d bytes (%d more), %v", bufs[w].n, bufs[w].over, err)
				return false
			}
			return true
		}
	})
	elapsed = time.Since(start)
	r.rawGet = float64(count) / elapsed.Seconds()
	fmt.Printf("<!-- the Go client alone, GETs: %s -->\n", split(elapsed))
	r.rawGetCPU, r.rawGetSrv = cpuTime(syscall.RUSAGE_SELF)-cpu0, c.serverCPU()-srv0
	return r
}

// sinkBuf receives a streamed reply into b, unchecked; bytes past len(b)
// are counted in over.
type sinkBuf struct {
	b       []byte
	n, over int
}

func (k *sinkBuf) ReadFrom(r io.Reader) (int64, error) {
	var total int64
	for {
		if k.n == len(k.b) {
			m, err := io.Copy(io.Discard, r)
			k.over += int(m)
			return total + m, err
		}
		m, err := r.Read(k.b[k.n:])
		k.n += m
		total += int64(m)
		if err == io.EOF {
			return total, nil
		}
		if err != nil {
			return total, err
		}
	}
}

func (k *sinkBuf) Write(p []byte) (int, error) {
	m := copy(k.b[k.n:], p)
	k.n += m
	k.over += len(p) - m
	return len(p), nil
}

// tierResult is benchTier's: rates, CPU time and the masters' CPU time of
// the put and get phases (Get, GetDirect; GetDirect with each worker's
// keys on one master, and a keyspace a call), and of the client's own SETs
// (raw).
type tierResult struct {
	put, putFrom, get, getDirect, pinned, calls, callsOrder, raw                         float64
	putCPU, putFromCPU, getCPU, getDirectCPU, pinnedCPU, callsCPU, callsOrderCPU, rawCPU time.Duration
	putSrv, putFromSrv, getSrv, getDirectSrv, pinnedSrv, callsSrv, callsOrderSrv, rawSrv time.Duration
	rawGet                                                                               float64
	rawGetCPU, rawGetSrv                                                                 time.Duration
}

// serverCPU is the user+system time the cluster's running masters have
// used so far (/proc/PID/stat, in clock ticks of 10 ms: Linux's USER_HZ
// is 100 on every architecture Go supports here); 0 where it cannot be read.
func (c *testCluster) serverCPU() time.Duration {
	var total time.Duration
	for _, d := range c.serverCPUEach() {
		total += d
	}
	return total
}

// serverCPUEach is serverCPU of each master (c.ports order); 0 for one whose
// time cannot be read.
func (c *testCluster) serverCPUEach() []time.Duration {
	each := make([]time.Duration, c.masters)
	for m, p := range c.ports[:c.masters] {
		cmd := c.procs[p]
		if cmd == nil || cmd.Process == nil {
			continue
		}
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", cmd.Process.Pid))
		if err != nil {
			continue
		}
		// The fields after the command's name in parentheses: utime and
		// stime are the 12th and 13th of them (fields 14 and 15 of stat).
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) < 13 {
			continue
		}
		u, err1 := strconv.ParseInt(f[11], 10, 64)
		st, err2 := strconv.ParseInt(f[12], 10, 64)
		if err1 == nil && err2 == nil {
			each[m] = time.Duration(u+st) * 10 * time.Millisecond
		}
	}
	return each
}

// mastersSplit reads, at the start of a phase, each master's calls of cmd
// and CPU time; its result, called at the phase's end, says how the phase's
// calls and CPU were shared among the masters ("" where they cannot be
// read): a tier whose keys pile on one master is bound by that one.
func mastersSplit(c *testCluster, cmd string) func(elapsed time.Duration) string {
	w, err := newCallsWatch(c.ports[:c.masters], cmd)
	if err != nil {
		return func(time.Duration) string { return "" }
	}
	calls0, err0 := w.callsEach()
	cpu0 := c.serverCPUEach()
	return func(elapsed time.Duration) string {
		defer w.close()
		calls1, err1 := w.callsEach()
		cpu1 := c.serverCPUEach()
		if err0 != nil || err1 != nil || elapsed <= 0 {
			return ""
		}
		var total int64
		for m := range calls1 {
			total += calls1[m] - calls0[m]
		}
		var shares, cores []string
		for m := range calls1 {
			shares = append(shares, fmt.Sprintf("%.0f%%", 100*float64(calls1[m]-calls0[m])/float64(max(total, 1))))
			cores = append(cores, fmt.Sprintf("%.2f", float64(cpu1[m]-cpu0[m])/float64(elapsed)))
		}
		return fmt.Sprintf("%s calls a master %s, cores a master %s", cmd, strings.Join(shares, "/"), strings.Join(cores, "/"))
	}
}

func count1(ok []bool) int { return count(ok) }

// benchSize is the record size of BenchmarkPut and BenchmarkGet (header
// included): 256 KiB, the size issue 27 measures against redis-benchmark.
const benchSize = 256 << 10

// BenchmarkPut puts benchSize records, 24 in flight (as
// TestBenchVsRedisBenchmark's 6 connections × depth 4), over the shared
// cluster; for pprof: go test -bench Put -cpuprofile ... ./tier/cluster.
func BenchmarkPut(b *testing.B) { ioVariants(b, benchPut) }

// BenchmarkGet gets benchSize records, 6 goroutines asking for 4 keys a call.
func BenchmarkGet(b *testing.B) { ioVariants(b, func(b *testing.B) { benchGet(b, false) }) }

// BenchmarkGetDirect: BenchmarkGet's reads with GetDirect (the payload
// received into the destination), the client's buffers as tuned.
func BenchmarkGetDirect(b *testing.B) { benchGet(b, true) }

// ioVariants runs f with the client's buffers as this package sets them
// ("tuned") and as the client's defaults ("defaults": 512 KiB buffers, no
// StringWriter conn), for the profile and the comparison.
func ioVariants(b *testing.B, f func(*testing.B)) {
	saved := ioBuffers
	defer func() { ioBuffers = saved }()
	for _, v := range []struct {
		name string
		set  func()
	}{
		{"tuned", func() { ioBuffers = saved }},
		{"pipelined", func() { ioBuffers = saved; ioBuffers.stream = false }},
		{"defaults", func() { ioBuffers.read, ioBuffers.write, ioBuffers.stringConn, ioBuffers.stream = 0, 0, false, false }},
		{"flush20us", func() { ioBuffers = saved; ioBuffers.flushDelay = 20 * time.Microsecond }},
		{"16K", func() { ioBuffers = saved; ioBuffers.read, ioBuffers.write = 16<<10, 16<<10 }},
		{"write64K", func() { ioBuffers = saved; ioBuffers.write = 64 << 10 }},
	} {
		v.set()
		b.Run(v.name, f)
	}
}

func benchPut(b *testing.B) {
	c := shared(b)
	const outstanding = 24
	sem := make(chan struct{}, outstanding)
	s, err := Open(context.Background(), Config{Addrs: c.addrs(), Namespace: "benchput", Fingerprint: 1,
		MaxInFlightBytes: outstanding * benchSize, Timeout: 10 * time.Second, OnPutDone: func([16]byte, bool) { <-sem }})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	payload := make([]byte, benchSize-record.HeaderSize)
	keys := keysN(96, 0xb1)
	b.SetBytes(benchSize)
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		sem <- struct{}{}
		if !s.PutAsync(keys[i%len(keys)], payload) {
			b.Fatal("dropped")
		}
	}
	s.Flush()
	// Not Close: it waits for the client's goroutines, among them, now
	// and then, one that sleeps 5s before closing connections a topology
	// refresh replaced (rueidis' _refresh), which made a run read 1.67
	// ms a put instead of 0.1.
	b.StopTimer()
}

func benchGet(b *testing.B, direct bool) {
	c := shared(b)
	s, err := Open(context.Background(), Config{Addrs: c.addrs(), Namespace: "benchget", Fingerprint: 1, Timeout: 10 * time.Second})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	payload := make([]byte, benchSize-record.HeaderSize)
	keys := keysN(96, 0xb2)
	for _, k := range keys {
		s.PutAsync(k, payload)
	}
	s.Flush()
	get := s.Get
	if direct {
		get = s.GetDirect
	}
	b.SetBytes(benchSize)
	b.ReportAllocs()
	b.ResetTimer()
	inBatches(6, 4, b.N, func(w int) func(i, n int) bool {
		ks := make([][16]byte, 4)
		ds := dstsN(4, benchSize-record.HeaderSize)
		return func(i, n int) bool {
			for j := range n {
				ks[j] = keys[(i+j+w)%len(keys)]
			}
			if got := count(get(context.Background(), ks[:n], ds[:n])); got != n {
				b.Errorf("%d of %d hits", got, n)
				return false
			}
			return true
		}
	})
	b.StopTimer() // not Close (see benchPut)
}

// inBatches runs workers goroutines that share requests [0, count) in
// batches of at most depth, as clients of -c workers -P depth do: worker w
// makes its scratch and its batch function with worker(w), then takes the
// next batch and calls it (requests i to i+n-1) until none is left or it
// returns false. inBatches returns when every worker has.
func inBatches(workers, depth, count int, worker func(w int) func(i, n int) bool) {
	var next atomic.Int64
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			batch := worker(w)
			for {
				i := int(next.Add(int64(depth))) - depth
				if i >= count || !batch(i, min(depth, count-i)) {
					return
				}
			}
		}()
	}
	wg.Wait()
}

// The benchmark's reference rate rests on callsWatch: it counts the
// masters' calls of a command across the cluster (not other commands), and
// its span closes once they have all been served.
func TestCallsWatch(t *testing.T) {
	c := shared(t)
	w, err := newCallsWatch(c.ports[:3], "setex")
	require.NoError(t, err)
	defer w.close()
	s, err := Open(context.Background(), Config{Addrs: c.addrs(), Namespace: "watch", Timeout: 5 * time.Second})
	require.NoError(t, err)
	defer s.Close()
	client := s.cl()
	const n = 40
	done := make(chan callsSpan, 1)
	go func() { done <- w.wait(n, 20*time.Second) }()
	time.Sleep(20 * time.Millisecond)
	for i := range n {
		key := fmt.Sprintf("watch-%d", i) // spread over the masters' slots
		require.NoError(t, client.Do(context.Background(), client.B().Get().Key(key).Build()).NonRedisError())
		require.NoError(t, client.Do(context.Background(), client.B().Setex().Key(key).Seconds(60).Value("v").Build()).Error())
	}
	span := <-done
	require.NoError(t, span.err)
	require.False(t, span.end.Before(span.start), "span %v .. %v", span.start, span.end)
	got, err := w.calls()
	require.NoError(t, err)
	require.Equal(t, w.base+n, got, "SETEX calls beyond the base: the GETs are not counted")
	// A count that never comes is an error, not a span.
	short := w.wait(n+1, 50*time.Millisecond)
	require.Error(t, short.err)
}

func TestParseCalls(t *testing.T) {
	body := "# Commandstats\r\ncmdstat_get:calls=12,usec=30,usec_per_call=2.50\r\ncmdstat_set:calls=7,usec=21\r\n"
	reply := fmt.Sprintf("$%d\r\n%s\r\n", len(body), body)
	for cmd, want := range map[string]int64{"get": 12, "set": 7, "del": 0} {
		n, err := parseCalls(bufio.NewReader(strings.NewReader(reply)), cmd)
		require.NoError(t, err)
		require.Equal(t, want, n, cmd)
	}
	for _, bad := range []string{"-ERR no\r\n", "$x\r\n", "$99999999\r\n", "$10\r\nshort"} {
		_, err := parseCalls(bufio.NewReader(strings.NewReader(bad)), "get")
		require.Error(t, err, "%q", bad)
	}
}

// balancedKeys returns n block keys whose cluster keys (key(gen, k)) fall
// as evenly as n allows on the masters of a cluster whose slots are split
// as clustertest's assign splits them (master m holds the m-th of masters
// equal ranges).
func balancedKeys(key func(uint64, [16]byte) string, gen uint64, n, masters int, seed byte) [][16]byte {
	per := make([]int, masters)
	var out [][16]byte
	for _, k := range keysN(min(65536, 64*n), seed) {
		m := int(keySlot(key(gen, k))) * masters / 16384
		if per[m] < (n+masters-1-m)/masters {
			per[m]++
			out = append(out, k)
			if len(out) == n {
				break
			}
		}
	}
	return out
}

// The benchmark's keys: keySlot agrees with the servers' CLUSTER KEYSLOT,
// and balancedKeys' keys land as many on each master (the masters' own
// count of the GETs of each key once).
func TestBalancedKeys(t *testing.T) {
	c := shared(t)
	s := open(t, c, Config{Timeout: 5 * time.Second})
	var ks []string
	for _, k := range keysN(20, 0x5a) {
		ks = append(ks, s.key(7, k))
	}
	// Hash tags: the first {...} that is not empty, else the whole key.
	ks = append(ks, "a{b}c", "{}x", "x{", "{a}{b}", "a{}{b}", "x}{y}", "{kvo}:ns:3:00ff", "{{a}}")
	for _, key := range ks {
		out, err := c.cli(c.ports[0], "cluster", "keyslot", key)
		require.NoError(t, err)
		require.Equal(t, strings.TrimSpace(out), strconv.Itoa(int(keySlot(key))), key)
	}
	keys := balancedKeys(s.key, s.gen.Load(), 96, c.masters, 0x5b)
	require.Len(t, keys, 96)
	w, err := newCallsWatch(c.ports[:c.masters], "get")
	require.NoError(t, err)
	defer w.close()
	before, err := w.callsEach()
	require.NoError(t, err)
	s.Get(context.Background(), keys, dstsN(len(keys), 8))
	after, err := w.callsEach()
	require.NoError(t, err)
	for m := range after {
		require.EqualValues(t, 32, after[m]-before[m], "master %d's GETs (before %v, after %v)", m, before, after)
	}
}

// quantiles describes streamed GETs' times to their first byte and from it
// to their last: medians and 90th percentiles.
func quantiles(queued, moved []time.Duration) string {
	if len(queued) == 0 {
		return "no streamed GET timed"
	}
	q := func(ds []time.Duration, p float64) time.Duration {
		s := append([]time.Duration(nil), ds...)
		sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
		return s[min(len(s)-1, int(p*float64(len(s))))].Round(time.Microsecond)
	}
	return fmt.Sprintf("%d streamed GETs: to the first byte %v median, %v p90; first to last byte %v median, %v p90",
		len(queued), q(queued, 0.5), q(queued, 0.9), q(moved, 0.5), q(moved, 0.9))
}
