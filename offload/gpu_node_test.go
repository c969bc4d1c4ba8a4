package offload

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
	"github.com/kvoffload/kvoffload/internal/nodepool"
)

// The node pool on one GPU (issue 25's H200 checks). A node process and
// client processes, each client this test binary re-executed
// (KVO_NODEGPU_CHILD=1) with its own CUDA context on device 0, its own
// KV tensors in device memory, and an engine of Dial: (1) one client
// stores, the other loads, byte-exact; (2) each alone and both at once
// store and load, against the same run's contiguous link; (3) a client
// SIGKILLed mid-store leaves no wrong block; (4) the two ranks of TP=2
// store, a TP=1 process loads, byte-exact; (5) how long the clients take
// to map and pin the node's regions against an embedded engine's pool of
// the same size. The node is `kvoffload serve` when KVOFFLOAD_BIN names
// the CLI, else a nodepool.Server in this test process (which then holds
// no CUDA context). TestGPUNodePool runs it on the GPU and writes the
// table to $KVO_BENCH_OUT/nodepool.md; TestCUDAFakeNodePool runs the same
// programs with the fake driver, small.

// ngSize is a run's sizes.
type ngSize struct {
	fake                bool
	blocks              int   // 8B-class blocks per client (2 MiB each)
	killBlocks          int   // blocks the killed client stores
	reps                int   // repetitions of each timed store and load
	pool, region        int64 // the node's pool and region bytes
	linkBytes, tpBlocks int
}

// TestGPUNodePool runs the node pool checks on the GPU: 256 MiB per
// client in the tests suite, 1 GiB per client and a 4 GiB pool with
// KVO_NODEGPU_FULL=1 (the nodepool suite of scripts/gpu/run.sh).
func TestGPUNodePool(t *testing.T) {
	drv, err := cuda.Load()
	if err != nil {
		cudatest.Skip(t, err.Error())
	}
	if n, err := drv.DeviceCount(); err != nil || n == 0 {
		cudatest.Skip(t, "no CUDA device")
	}
	sz := ngSize{blocks: 128, killBlocks: 128, reps: 4, pool: 1 << 30, region: 256 << 20, linkBytes: 256 << 20, tpBlocks: 32}
	if os.Getenv("KVO_NODEGPU_FULL") == "1" { // the nodepool suite's sizes
		sz = ngSize{blocks: 512, killBlocks: 512, reps: 8, pool: 4 << 30, region: 1 << 30, linkBytes: 1 << 30, tpBlocks: 64}
	}
	nodeGPUChecks(t, sz)
}

// TestCUDAFakeNodePool runs the same client programs on the fake driver
// (host memory as the device; the rates mean nothing).
func TestCUDAFakeNodePool(t *testing.T) {
	if testing.Short() {
		t.Skip("starts eight processes")
	}
	nodeGPUChecks(t, ngSize{fake: true, blocks: 6, killBlocks: 6, reps: 2, pool: 48 << 20, region: 16 << 20, linkBytes: 8 << 20, tpBlocks: 8})
}

func nodeGPUChecks(t *testing.T, sz ngSize) {
	dir := t.TempDir()
	socket := filepath.Join(dir, "node.sock")
	nodeStart, pageMode, how := startGPUNode(t, socket, sz)
	n := sz.blocks
	var rows []string
	row := func(format string, a ...any) {
		rows = append(rows, fmt.Sprintf(format, a...))
	}

	// (5) first: the first and second client's Dial (first region pinned)
	// and every region pinned, then an embedded engine's pool.
	a := startNGChild(t, socket, "8b", n, sz)
	da := a.do(t, "dial")
	b := startNGChild(t, socket, "8b", n, sz)
	db := b.do(t, "dial")
	require.Equal(t, strings.ReplaceAll(pageMode, " ", "_"), da["pagemode"], "the client reports the node's page mode")
	e := startNGChild(t, socket, "8b", n, sz)
	de := e.do(t, fmt.Sprintf("embedded %d %d", sz.pool, sz.region))
	e.do(t, "quit")
	e.wait(t)

	// (1) A stores, B loads, byte-exact; and the other way.
	a.do(t, fmt.Sprintf("fill 1 0 %d", n))
	st := a.do(t, fmt.Sprintf("store 1 0 %d", n))
	require.Equal(t, strconv.Itoa(n), st["stored"])
	ld := b.do(t, fmt.Sprintf("load 1 0 %d", n))
	require.Equal(t, [3]string{strconv.Itoa(n), "0", "0"}, [3]string{ld["loaded"], ld["missing"], ld["wrong"]}, "B loads what A stored")
	b.do(t, fmt.Sprintf("fill 2 0 %d", n))
	require.Equal(t, strconv.Itoa(n), b.do(t, fmt.Sprintf("store 2 0 %d", n))["stored"])
	ld2 := a.do(t, fmt.Sprintf("load 2 0 %d", n))
	require.Equal(t, [3]string{strconv.Itoa(n), "0", "0"}, [3]string{ld2["loaded"], ld2["missing"], ld2["wrong"]}, "A loads what B stored")

	// (2) the same run's link, each alone, both at once.
	link := a.do(t, fmt.Sprintf("link %d", sz.linkBytes))
	type rate struct{ alone, both, aOnly float64 }
	var res [2]rate
	for i, dirn := range []string{"load", "store"} {
		// Loads reload the keys stored above; stores take fresh keys
		// each repetition (seeds 100.. and 200..).
		seedA, seedB := "1", "2"
		if dirn == "store" {
			seedA, seedB = "100", "200"
		}
		alone := a.do(t, fmt.Sprintf("bench %s %s 0 %d %d", dirn, seedA, n, sz.reps))
		res[i].alone = ngRate(t, alone)
		if dirn == "store" {
			seedA, seedB = "300", "400"
		}
		a.send(t, fmt.Sprintf("bench %s %s 0 %d %d", dirn, seedA, n, sz.reps))
		b.send(t, fmt.Sprintf("bench %s %s 0 %d %d", dirn, seedB, n, sz.reps))
		ra, rb := a.reply(t), b.reply(t)
		res[i].both = ngRate(t, ra, rb)
		res[i].aOnly = ngRate(t, ra)
	}
	h2d, d2h := ngFloat(t, link, "h2d"), ngFloat(t, link, "d2h")

	// (3) a client SIGKILLed mid-store, three times (at once after its
	// Store returned, then 2 and 10 ms later): B loads every block of
	// the killed store it can and checks every byte, then stores and
	// loads back as many blocks again.
	kills := []time.Duration{0, 2 * time.Millisecond, 10 * time.Millisecond}
	var killNotes []string
	for round, after := range kills {
		k := startNGChild(t, socket, "8b", sz.killBlocks, sz)
		k.do(t, "dial")
		seed := 500 + round
		k.do(t, fmt.Sprintf("fill %d 0 %d", seed, sz.killBlocks))
		k.send(t, fmt.Sprintf("storego %d 0 %d", seed, sz.killBlocks))
		require.Equal(t, "issued", k.line(t))
		time.Sleep(after)
		require.NoError(t, k.cmd.Process.Signal(syscall.SIGKILL))
		_ = k.cmd.Wait()
		// The node releases the dead client's reservations once it has
		// exited: B's view of the node's slots says when.
		deadline := time.Now().Add(30 * time.Second)
		for {
			s := b.do(t, "stats")
			if s["held"] == "0" {
				break
			}
			require.True(t, time.Now().Before(deadline), "the killed client's reservations never released: %v", s)
			time.Sleep(10 * time.Millisecond)
		}
		got := b.do(t, fmt.Sprintf("load %d 0 %d", seed, sz.killBlocks))
		require.Equal(t, "0", got["wrong"], "round %d: a wrong block after the kill", round)
		require.Equal(t, strconv.Itoa(sz.killBlocks), strconv.Itoa(ngInt(t, got, "loaded")+ngInt(t, got, "missing")))
		b.do(t, fmt.Sprintf("fill %d 0 %d", 600+round, n))
		require.Equal(t, strconv.Itoa(n), b.do(t, fmt.Sprintf("store %d 0 %d", 600+round, n))["stored"])
		again := a.do(t, fmt.Sprintf("load %d 0 %d", 600+round, n))
		require.Equal(t, [3]string{strconv.Itoa(n), "0", "0"}, [3]string{again["loaded"], again["missing"], again["wrong"]}, "round %d: stored after the kill", round)
		killNotes = append(killNotes, fmt.Sprintf("killed %v after Store returned: %s of %d blocks became ready, 0 wrong", after, got["loaded"], sz.killBlocks))
	}

	// (4) the two ranks of TP=2, then a TP=1 process.
	r0 := startNGChild(t, socket, "tp:2:0", sz.tpBlocks, sz)
	r1 := startNGChild(t, socket, "tp:2:1", sz.tpBlocks, sz)
	t1 := startNGChild(t, socket, "tp:1:0", sz.tpBlocks, sz)
	for _, c := range []*ngChild{r0, r1, t1} {
		c.do(t, "dial")
	}
	tb := sz.tpBlocks
	r0.do(t, fmt.Sprintf("fill 7 0 %d", tb))
	r1.do(t, fmt.Sprintf("fill 7 0 %d", tb))
	require.Equal(t, strconv.Itoa(tb), r0.do(t, fmt.Sprintf("store 7 0 %d", tb))["stored"])
	half := t1.do(t, fmt.Sprintf("load 7 0 %d", tb))
	require.Equal(t, [3]string{"0", strconv.Itoa(tb), "0"}, [3]string{half["loaded"], half["missing"], half["wrong"]}, "invisible before rank 1's heads")
	require.Equal(t, strconv.Itoa(tb), r1.do(t, fmt.Sprintf("store 7 0 %d", tb))["stored"])
	full := t1.do(t, fmt.Sprintf("load 7 0 %d", tb))
	require.Equal(t, [3]string{strconv.Itoa(tb), "0", "0"}, [3]string{full["loaded"], full["missing"], full["wrong"]}, "TP=1 loads both ranks' heads")
	for _, c := range []*ngChild{r0, r1, t1, a, b} {
		c.do(t, "quit")
		c.wait(t)
	}

	kind := "GPU (one device, one CUDA context per process)"
	if sz.fake {
		kind = "the fake driver (host memory: rates mean nothing)"
	}
	ms := func(m map[string]string, k string) string { return m[k] + " ms" }
	row("| (5) node start: map and populate %s (%s) | %d ms | |", size(sz.pool), how, nodeStart.Milliseconds())
	row("| (5) first client: Dial (first region pinned) / every region pinned | %s / %s | |", ms(da, "dial_ms"), ms(da, "all_ms"))
	row("| (5) second client: Dial / every region pinned | %s / %s | |", ms(db, "dial_ms"), ms(db, "all_ms"))
	row("| (5) embedded engine, same pool (%s, anonymous, %s): first slot / every region pinned | %s / %s | |", size(sz.pool), de["pages"], ms(de, "first_ms"), ms(de, "full_ms"))
	row("| (1) A stores %d blocks, B loads them; B stores, A loads | byte-exact, both ways | |", n)
	for i, dirn := range []string{"load", "store"} {
		ref := h2d
		if dirn == "store" {
			ref = d2h
		}
		verdict := "met"
		if res[i].both < 0.9*res[i].alone {
			verdict = "**missed**"
		}
		row("| (2) %s, one process alone | %.1f GB/s (%.1f%% of the link, %.1f) | |", dirn, res[i].alone, 100*res[i].alone/ref, ref)
		row("| (2) %s, two processes at once, together | %.1f GB/s (%.1f%% of the link; A alone within it: %.1f) | %.2f× one alone (target ≥ 0.90: %s) |",
			dirn, res[i].both, 100*res[i].both/ref, res[i].aOnly, res[i].both/res[i].alone, verdict)
	}
	for _, k := range killNotes {
		row("| (3) %s | no wrong block; fresh stores after it load byte-exact | |", k)
	}
	row("| (4) TP=2 ranks store their heads of %d blocks (invisible after rank 0 alone), TP=1 loads | byte-exact | |", tb)
	table := fmt.Sprintf("# The node pool on %s\n\nPage mode of the node's regions: %s. Blocks of 2 MiB (8B-class: 32 layers, "+
		"8 KV heads of 128 bf16, 16 tokens, layer-separate), %d per client; node pool %s in regions of %s. Rates: %d repetitions of "+
		"%d blocks per process, bytes over the wall time (both at once: from the first start to the last end). Link: one contiguous "+
		"%s copy between pinned memory and the device, best of 3, in the same run.\n\n| check | result | ratio |\n|---|---|---|\n%s\n",
		kind, pageMode, n, size(sz.pool), size(sz.region), sz.reps, n, size(int64(sz.linkBytes)), strings.Join(rows, "\n"))
	t.Log("\n" + table)
	if out := os.Getenv("KVO_BENCH_OUT"); out != "" && !sz.fake && os.Getenv("KVO_NODEGPU_FULL") == "1" {
		require.NoError(t, os.WriteFile(filepath.Join(out, "nodepool.md"), []byte(table), 0o644))
	}
}

func size(b int64) string {
	switch {
	case b >= 1<<30 && b%(1<<30) == 0:
		return fmt.Sprintf("%d GiB", b>>30)
	case b >= 1<<20:
		return fmt.Sprintf("%d MiB", b>>20)
	}
	return fmt.Sprintf("%d B", b)
}

// startGPUNode starts the node and returns how long it took to map and
// populate its pool, its page mode, and what runs it.
func startGPUNode(t *testing.T, socket string, sz ngSize) (time.Duration, string, string) {
	t.Helper()
	start := time.Now()
	if bin := os.Getenv("KVOFFLOAD_BIN"); bin != "" {
		cmd := exec.Command(bin, "serve", "--socket", socket, "--pool", strconv.FormatInt(sz.pool, 10), "--region", strconv.FormatInt(sz.region, 10))
		out, err := cmd.StdoutPipe()
		require.NoError(t, err)
		cmd.Stderr = os.Stderr
		require.NoError(t, cmd.Start())
		t.Cleanup(func() {
			_ = cmd.Process.Signal(syscall.SIGTERM)
			_ = cmd.Wait()
		})
		line, err := bufio.NewReader(out).ReadString('\n')
		require.NoError(t, err)
		took := time.Since(start)
		go func() { _, _ = io.Copy(io.Discard, out) }()
		// "kvoffload serve: listening on PATH (pool SIZE, PAGEMODE)"
		i := strings.Index(line, ", ")
		require.True(t, strings.Contains(line, "listening") && i > 0, "kvoffload serve said %q", line)
		return took, strings.TrimSuffix(strings.TrimSpace(line[i+2:]), ")"), "kvoffload serve"
	}
	s, err := nodepool.NewServer(nodepool.ServerConfig{Socket: socket, PoolBytes: sz.pool, RegionBytes: sz.region, HugeTLB: true})
	require.NoError(t, err)
	took := time.Since(start)
	done := make(chan error, 1)
	go func() { done <- s.Serve() }()
	t.Cleanup(func() {
		_ = s.Close()
		<-done
	})
	return took, s.PageMode(), "nodepool.Server in the test process"
}

// ngChild is a client process: one command a line on its stdin, one
// reply a line ("ok k=v ...", or "error ...").
type ngChild struct {
	cmd   *exec.Cmd
	in    io.WriteCloser
	lines chan string
	name  string
}

func startNGChild(t *testing.T, socket, layout string, blocks int, sz ngSize) *ngChild {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	fake := "0"
	if sz.fake {
		fake = "1"
	}
	cmd.Env = append(os.Environ(), "KVO_NODEGPU_CHILD=1", "KVO_NODEGPU_SOCKET="+socket, "KVO_NODEGPU_FAKE="+fake,
		fmt.Sprintf("KVO_NODEGPU_LAYOUT=%s:%d", layout, blocks), "GORACE="+strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
	in, err := cmd.StdinPipe()
	require.NoError(t, err)
	lines := startChild(t, cmd, 16)
	return &ngChild{cmd: cmd, in: in, lines: lines, name: fmt.Sprintf("%s pid %d", layout, cmd.Process.Pid)}
}

func (c *ngChild) send(t *testing.T, line string) {
	t.Helper()
	_, err := io.WriteString(c.in, line+"\n")
	require.NoError(t, err, "%s: %s", c.name, line)
}

func (c *ngChild) line(t *testing.T) string {
	t.Helper()
	select {
	case l, ok := <-c.lines:
		require.True(t, ok, "%s ended", c.name)
		return l
	case <-time.After(120 * time.Second):
		t.Fatalf("%s silent for 2 minutes", c.name)
	}
	return ""
}

// reply reads an "ok k=v ..." line into a map; an error line fails t.
func (c *ngChild) reply(t *testing.T) map[string]string {
	t.Helper()
	l := c.line(t)
	f := strings.Fields(l)
	require.True(t, len(f) > 0 && f[0] == "ok", "%s: %s", c.name, l)
	m := map[string]string{}
	for _, kv := range f[1:] {
		k, v, _ := strings.Cut(kv, "=")
		m[k] = v
	}
	return m
}

func (c *ngChild) do(t *testing.T, line string) map[string]string {
	t.Helper()
	c.send(t, line)
	return c.reply(t)
}

func (c *ngChild) wait(t *testing.T) {
	t.Helper()
	for range c.lines {
	}
	require.NoError(t, c.cmd.Wait(), c.name)
}

func ngInt(t *testing.T, m map[string]string, k string) int {
	t.Helper()
	v, err := strconv.Atoi(m[k])
	require.NoError(t, err, "%s in %v", k, m)
	return v
}

func ngFloat(t *testing.T, m map[string]string, k string) float64 {
	t.Helper()
	v, err := strconv.ParseFloat(m[k], 64)
	require.NoError(t, err, "%s in %v", k, m)
	return v
}

// ngRate is the bytes of the bench replies over the wall time from the
// first start to the last end, in GB/s.
func ngRate(t *testing.T, replies ...map[string]string) float64 {
	t.Helper()
	var bytes, start, end int64
	for i, r := range replies {
		b, err := strconv.ParseInt(r["bytes"], 10, 64)
		require.NoError(t, err)
		s, err := strconv.ParseInt(r["start"], 10, 64)
		require.NoError(t, err)
		e, err := strconv.ParseInt(r["end"], 10, 64)
		require.NoError(t, err)
		bytes += b
		if i == 0 || s < start {
			start = s
		}
		end = max(end, e)
	}
	require.Greater(t, end, start)
	return float64(bytes) / float64(end-start)
}

// ---------------------------------------------------------------- the client process

// ngProc is a client process's state: its driver and context, its KV
// tensors, and its engine of Dial.
type ngProc struct {
	drv    cuda.Driver
	fake   bool
	socket string
	l      LayoutSpec
	tp     bool
	slot   int64
	allocs []cuda.DevicePtr
	bounce unsafe.Pointer
	buf    []byte
	e      *Engine
	out    *bufio.Writer
}

// ngKey is key i of a seed.
func ngKey(seed, i int) Key {
	var k Key
	k[0], k[1], k[2], k[3] = byte(seed), byte(seed>>8), byte(i), byte(i>>8)
	k[4], k[15] = 0x6E, 0x9D
	return k
}

// runNodeGPUChild is a client process (KVO_NODEGPU_CHILD=1): it runs the
// commands on its stdin until quit or EOF.
func runNodeGPUChild() int {
	runtime.LockOSThread()
	p := &ngProc{socket: os.Getenv("KVO_NODEGPU_SOCKET"), fake: os.Getenv("KVO_NODEGPU_FAKE") == "1", out: bufio.NewWriter(os.Stdout)}
	say := func(format string, a ...any) {
		fmt.Fprintf(p.out, format+"\n", a...)
		_ = p.out.Flush()
	}
	if err := p.open(os.Getenv("KVO_NODEGPU_LAYOUT")); err != nil {
		say("error %v", err)
		return 1
	}
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		if f[0] == "quit" {
			if p.e != nil {
				if err := p.e.Close(); err != nil {
					say("error close: %v", err)
					return 1
				}
			}
			say("ok")
			return 0
		}
		reply, err := p.run(f, say)
		if err != nil {
			say("error %s: %v", f[0], err)
			continue
		}
		say("ok %s", reply)
	}
	return 0
}

// open loads the driver (the fake one when asked), makes device 0's
// primary context current on this thread and allocates the KV tensors of
// spec: "8b:BLOCKS" or "tp:TP:RANK:BLOCKS".
func (p *ngProc) open(spec string) error {
	if p.fake {
		p.drv = cudafake.New(cudafake.Options{DeviceMemory: 256 << 20})
	} else {
		drv, err := cuda.Load()
		if err != nil {
			return err
		}
		p.drv = drv
	}
	dev, err := p.drv.DeviceGet(0)
	if err != nil {
		return err
	}
	ctx, err := p.drv.PrimaryCtxRetain(dev)
	if err != nil {
		return err
	}
	if err := p.drv.CtxSetCurrent(ctx); err != nil {
		return err
	}
	f := strings.Split(spec, ":")
	num := func(s string) int { v, _ := strconv.Atoi(s); return v }
	var seg uint64
	switch {
	case f[0] == "8b" && len(f) == 2:
		p.l = LayoutSpec{Kind: LayoutLayerSeparate, Layers: 32, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: num(f[1])}
		seg = 32 << 10
	case f[0] == "tp" && len(f) == 4:
		tp, r := num(f[1]), num(f[2])
		h := 8 / tp
		p.l = LayoutSpec{Kind: LayoutLayerSeparate, Layers: 32, KVHeads: h, ModelKVHeads: 8, HeadFirst: r * h, HeadDim: 128, DTypeBytes: 2,
			TokensPerBlock: 16, NumBlocks: num(f[3]), Order: OrderTokenMajor}
		seg = uint64(16 * h * 128 * 2)
		p.tp = true
	default:
		return fmt.Errorf("layout %q", spec)
	}
	for range p.l.Layers {
		var lt LayerTensors
		for _, dst := range []*uint64{&lt.K, &lt.V} {
			d, err := p.drv.MemAlloc(seg * uint64(p.l.NumBlocks))
			if err != nil {
				return err
			}
			p.allocs = append(p.allocs, d)
			*dst = uint64(d)
		}
		lt.Stride = seg
		p.l.LayerTensors = append(p.l.LayerTensors, lt)
	}
	p.slot = int64(2 * p.l.Layers * int(seg))
	if p.bounce, err = p.drv.MemHostAlloc(uint64(p.slot), cuda.HostAllocPortable); err != nil {
		return err
	}
	p.buf = unsafe.Slice((*byte)(p.bounce), p.slot)
	return nil
}

func (p *ngProc) config() Config {
	ns := "nodegpu-8b" // one layout per namespace
	if p.tp {
		ns = "nodegpu-tp"
	}
	return Config{Backend: BackendCUDA, Layout: p.l, Namespace: ns, SkipMemoryCheck: true}
}

func (p *ngProc) hooks() engineHooks {
	drv := p.drv
	return engineHooks{loadDriver: loader(func() (cuda.Driver, error) { return drv, nil })}
}

// pieces are block id's device pieces (address, bytes) holding key i of
// seed: keyContent by the engine's segments (8b), or sequence block
// seed*1024+i of the model's KV (tp: tpDevice, the rank's heads).
func (p *ngProc) pieces(id, seed, i int) ([]uint64, [][]byte, error) {
	var addrs []uint64
	var data [][]byte
	if p.tp {
		for x, b := range tpDevice(p.l, seed*1024+i) {
			addrs, data = append(addrs, tpAddr(p.l, id, x/2, x%2)), append(data, b)
		}
		return addrs, data, nil
	}
	content := keyContent(ngKey(seed, i), p.slot)
	segs, err := p.e.layout.Segments(id, nil)
	if err != nil {
		return nil, nil, err
	}
	for _, s := range segs {
		addrs, data = append(addrs, s.Dev), append(data, content[s.Off:s.Off+s.Len])
	}
	return addrs, data, nil
}

// write and read move one piece through the pinned bounce buffer.
func (p *ngProc) write(addr uint64, b []byte) error {
	copy(p.buf, b)
	return p.drv.Memcpy(cuda.DevicePtr(addr), cuda.DevicePtr(uintptr(p.bounce)), uint64(len(b)))
}

func (p *ngProc) read(addr uint64, n int) ([]byte, error) {
	if err := p.drv.Memcpy(cuda.DevicePtr(uintptr(p.bounce)), cuda.DevicePtr(addr), uint64(n)); err != nil {
		return nil, err
	}
	return p.buf[:n], nil
}

func (p *ngProc) keys(seed, first, n int) ([]Key, []int, error) {
	if first < 0 || n <= 0 || first+n > p.l.NumBlocks {
		return nil, nil, fmt.Errorf("blocks %d..%d of %d", first, first+n, p.l.NumBlocks)
	}
	keys, ids := make([]Key, n), make([]int, n)
	for i := range keys {
		keys[i], ids[i] = ngKey(seed, i), first+i
	}
	return keys, ids, nil
}

func (p *ngProc) run(f []string, say func(string, ...any)) (string, error) {
	arg := func(i int) int {
		if i >= len(f) {
			return -1
		}
		v, err := strconv.Atoi(f[i])
		if err != nil {
			return -1
		}
		return v
	}
	if f[0] != "dial" && f[0] != "embedded" && f[0] != "link" && p.e == nil {
		return "", fmt.Errorf("not dialled")
	}
	switch f[0] {
	case "dial":
		start := time.Now()
		e, err := dialEngine(p.socket, p.config(), p.hooks())
		if err != nil {
			return "", err
		}
		p.e = e
		dial := time.Since(start)
		c := e.dial.client.Load()
		if !c.WaitRegions(2 * time.Minute) {
			return "", fmt.Errorf("the node's regions not all mapped in 2 minutes: %v", c.Info().RegionErrors)
		}
		all := time.Since(start)
		st := e.Stats()
		return fmt.Sprintf("dial_ms=%d all_ms=%d regions=%d owned=%d pagemode=%s", dial.Milliseconds(), all.Milliseconds(), st.Pool.Regions, st.Pool.OwnedBytes,
			strings.ReplaceAll(c.Info().PageMode, " ", "_")), nil
	case "embedded":
		pool, region := int64(arg(1)), int64(arg(2))
		cfg := p.config()
		cfg.PoolBytes, cfg.FirstRegionBytes, cfg.RegionBytes = pool, region, region
		h := p.hooks()
		h.copyOptions.Calibration = &cudacopy.Calibration{}
		start := time.Now()
		e, err := newEngine(cfg, h)
		if err != nil {
			return "", err
		}
		first := time.Since(start)
		for e.Stats().Pool.FullPool == 0 {
			if time.Since(start) > 2*time.Minute {
				return "", fmt.Errorf("the embedded pool not pinned in 2 minutes")
			}
			time.Sleep(time.Millisecond)
		}
		st := e.Stats()
		pages := "none"
		e.memory.mu.Lock()
		if len(e.memory.regions) > 0 {
			r := e.memory.regions[0].r
			pages = map[bool]string{true: "hugetlbfs", false: map[bool]string{true: "THP", false: "base_pages"}[r.THP()]}[r.HugeTLB()]
		}
		e.memory.mu.Unlock()
		if err := e.Close(); err != nil {
			return "", err
		}
		return fmt.Sprintf("first_ms=%d full_ms=%d first_slot_ms=%d pages=%s", first.Milliseconds(), st.Pool.FullPool.Milliseconds(), st.Pool.FirstSlot.Milliseconds(), pages), nil
	case "link":
		return p.link(uint64(arg(1)))
	case "fill":
		seed, first, n := arg(1), arg(2), arg(3)
		_, ids, err := p.keys(seed, first, n)
		if err != nil {
			return "", err
		}
		for i, id := range ids {
			addrs, data, err := p.pieces(id, seed, i)
			if err != nil {
				return "", err
			}
			for x := range addrs {
				if err := p.write(addrs[x], data[x]); err != nil {
					return "", err
				}
			}
		}
		return fmt.Sprintf("filled=%d", n), nil
	case "store", "storego":
		keys, ids, err := p.keys(arg(1), arg(2), arg(3))
		if err != nil {
			return "", err
		}
		start := time.Now()
		op, err := p.e.Store(context.Background(), keys, ids, StoreOptions{})
		if err != nil {
			return "", err
		}
		if f[0] == "storego" {
			say("issued")
		}
		out, err := ngWait(op)
		if err != nil {
			return "", err
		}
		return fmt.Sprintf("stored=%d of=%d ms=%d", countOutcome(out, OutcomeStored), len(out), time.Since(start).Milliseconds()), nil
	case "load":
		return p.load(arg(1), arg(2), arg(3))
	case "bench":
		return p.bench(f[1], arg(2), arg(3), arg(4), arg(5))
	case "stats":
		st := p.e.Stats()
		return fmt.Sprintf("ready=%d leased=%d held=%d free=%d total=%d", st.Pool.BlocksReady, st.Pool.BlocksLeased, st.Pool.SlotsTotal-st.Pool.SlotsFree-st.Pool.BlocksReady, st.Pool.SlotsFree, st.Pool.SlotsTotal), nil
	}
	return "", fmt.Errorf("unknown command %q", f[0])
}

func ngWait(op *Op) ([]Outcome, error) {
	werr := op.Wait(context.Background())
	out, err := op.Outcomes()
	if err != nil {
		return nil, err
	}
	if werr != nil {
		return nil, werr
	}
	return out, op.Release()
}

// load poisons the tensors, loads key 0..n-1 of seed into blocks
// first.., and checks every byte: loaded blocks hold their key's bytes,
// the others are still poison.
func (p *ngProc) load(seed, first, n int) (string, error) {
	keys, ids, err := p.keys(seed, first, n)
	if err != nil {
		return "", err
	}
	for _, lt := range p.l.LayerTensors {
		for _, a := range []uint64{lt.K, lt.V} {
			if err := p.drv.MemsetD8(cuda.DevicePtr(a), 0xEE, lt.Stride*uint64(p.l.NumBlocks)); err != nil {
				return "", err
			}
		}
	}
	start := time.Now()
	op, err := p.e.Load(context.Background(), keys, ids, LoadOptions{})
	if err != nil {
		return "", err
	}
	out, err := ngWait(op)
	if err != nil {
		return "", err
	}
	took := time.Since(start)
	loaded, missing, wrong := 0, 0, 0
	for i, oc := range out {
		addrs, data, err := p.pieces(ids[i], seed, i)
		if err != nil {
			return "", err
		}
		switch oc {
		case OutcomeLoaded:
			loaded++
		case OutcomeMissing:
			missing++
		default:
			return "", fmt.Errorf("key %d: outcome %v", i, oc)
		}
		ok := true
		for x, a := range addrs {
			got, err := p.read(a, len(data[x]))
			if err != nil {
				return "", err
			}
			want := data[x]
			if oc == OutcomeMissing {
				want = bytes.Repeat([]byte{0xEE}, len(want))
			}
			ok = ok && bytes.Equal(got, want)
		}
		if !ok {
			wrong++
		}
	}
	return fmt.Sprintf("loaded=%d missing=%d wrong=%d ms=%d", loaded, missing, wrong, took.Milliseconds()), nil
}

// bench stores (fresh keys each repetition: seeds seed, seed+1, ...) or
// loads (the keys of seed) blocks first..first+n-1 reps times, each
// repetition waited for, and reports the bytes moved between its first
// start and its last end (unix ns).
func (p *ngProc) bench(dirn string, seed, first, n, reps int) (string, error) {
	if reps <= 0 {
		return "", fmt.Errorf("reps %d", reps)
	}
	var moved int64
	var best time.Duration
	start := time.Now()
	for r := range reps {
		s := seed
		if dirn == "store" {
			s = seed + r
		}
		keys, ids, err := p.keys(s, first, n)
		if err != nil {
			return "", err
		}
		t0 := time.Now()
		var op *Op
		want := OutcomeLoaded
		if dirn == "store" {
			op, err = p.e.Store(context.Background(), keys, ids, StoreOptions{})
			want = OutcomeStored
		} else {
			op, err = p.e.Load(context.Background(), keys, ids, LoadOptions{})
		}
		if err != nil {
			return "", err
		}
		out, err := ngWait(op)
		if err != nil {
			return "", err
		}
		if c := countOutcome(out, want); c != n {
			return "", fmt.Errorf("%s repetition %d: %d of %d blocks, outcomes %v", dirn, r, c, n, out)
		}
		if d := time.Since(t0); best == 0 || d < best {
			best = d
		}
		moved += int64(n) * p.slot
	}
	end := time.Now()
	return fmt.Sprintf("bytes=%d start=%d end=%d best=%.2f", moved, start.UnixNano(), end.UnixNano(), float64(int64(n)*p.slot)/best.Seconds()/1e9), nil
}

// link times one contiguous copy of n bytes each way between pinned
// memory and one device allocation, best of 3, in GB/s.
func (p *ngProc) link(n uint64) (string, error) {
	host, err := p.drv.MemHostAlloc(n, cuda.HostAllocPortable)
	if err != nil {
		return "", err
	}
	defer func() { _ = p.drv.MemFreeHost(host) }()
	dev, err := p.drv.MemAlloc(n)
	if err != nil {
		return "", err
	}
	defer func() { _ = p.drv.MemFree(dev) }()
	rate := func(dst, src cuda.DevicePtr) (float64, error) {
		var d []time.Duration
		for range 3 {
			t0 := time.Now()
			if err := p.drv.Memcpy(dst, src, n); err != nil {
				return 0, err
			}
			d = append(d, time.Since(t0))
		}
		return float64(n) / slices.Min(d).Seconds() / 1e9, nil
	}
	h2d, err := rate(dev, cuda.DevicePtr(uintptr(host)))
	if err != nil {
		return "", err
	}
	d2h, err := rate(cuda.DevicePtr(uintptr(host)), dev)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("h2d=%.2f d2h=%.2f", h2d, d2h), nil
}
