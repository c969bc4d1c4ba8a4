package offload

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/kvoffload/kvoffload/internal/nodepool"
	"github.com/kvoffload/kvoffload/internal/tiered"
)

// TestMain runs a dialled-engine child role when the test binary is
// re-executed by startDialChild or startNGChild, the tests otherwise.
func TestMain(m *testing.M) {
	if os.Getenv("KVO_NODEGPU_CHILD") == "1" {
		os.Exit(runNodeGPUChild())
	}
	if role := os.Getenv("KVO_DIAL_CHILD"); role != "" {
		os.Exit(runDialChild(role, os.Getenv("KVO_DIAL_SOCKET"), os.Getenv("KVO_DIAL_ARGS")))
	}
	os.Exit(m.Run())
}

const dialBlocks = 64

// dialConfig is the dialled engines' config: the host backend simulating
// dialBlocks GPU blocks.
func dialConfig() Config {
	return Config{Backend: BackendHost, Layout: smallLayout(dialBlocks), PrefaultThreads: 1, StagingBytes: -1, Namespace: "dialtest"}
}

// startNode runs a node (what `kvoffload serve` runs) on socket.
func startNode(t *testing.T, socket string) *nodepool.Server {
	return startNodeConfig(t, nodepool.ServerConfig{Socket: socket, PoolBytes: 2 << 20, RegionBytes: 1 << 20, PrefaultThreads: 1})
}

// startNodeConfig runs a node of cfg, closed at the test's end.
func startNodeConfig(t *testing.T, cfg nodepool.ServerConfig) *nodepool.Server {
	t.Helper()
	s, err := nodepool.NewServer(cfg)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- s.Serve() }()
	var once bool
	stop := func() {
		if !once {
			once = true
			_ = s.Close()
			require.NoError(t, <-done)
		}
	}
	t.Cleanup(stop)
	return s
}

func dialKeys(seed, n int) []Key {
	keys := make([]Key, n)
	for i := range keys {
		keys[i] = testKey(seed<<10 | i)
	}
	return keys
}

// storeKeys writes keyContent into blocks 0..len(keys)-1 and stores them.
func storeKeys(e *Engine, keys []Key, opts StoreOptions) (*Op, error) {
	ids := make([]int, len(keys))
	for i, k := range keys {
		ids[i] = i
		if err := writeBlockErr(e, i, keyContent(k, e.slot)); err != nil {
			return nil, err
		}
	}
	return e.Store(context.Background(), keys, ids, opts)
}

func writeBlockErr(e *Engine, id int, content []byte) error {
	segs, err := e.layout.Segments(id, nil)
	if err != nil {
		return err
	}
	for _, s := range segs {
		if err := e.sim.Write(s.Dev, content[s.Off:s.Off+s.Len]); err != nil {
			return err
		}
	}
	return nil
}

// loadVerify loads keys into blocks dialBlocks/2.. and checks every loaded
// block byte for byte: it returns how many were loaded and missing.
// waitOut waits for op and returns its outcomes and Wait's error.
func waitOut(op *Op) ([]Outcome, error) {
	werr := op.Wait(context.Background())
	out, err := op.Outcomes()
	if err != nil {
		return nil, err
	}
	return out, werr
}

func loadVerify(e *Engine, keys []Key) (loaded, missing int, err error) {
	ids := make([]int, len(keys))
	for i := range keys {
		ids[i] = dialBlocks/2 + i
		if err := writeBlockErr(e, ids[i], make([]byte, e.slot)); err != nil {
			return 0, 0, err
		}
	}
	op, err := e.Load(context.Background(), keys, ids, LoadOptions{})
	if err != nil {
		return 0, 0, err
	}
	out, err := waitOut(op)
	if err != nil {
		return 0, 0, err
	}
	for i, oc := range out {
		switch oc {
		case OutcomeLoaded:
			loaded++
			if got := blockBytesErr(e, ids[i]); !bytes.Equal(got, keyContent(keys[i], e.slot)) {
				return loaded, missing, fmt.Errorf("key %d: wrong bytes loaded", i)
			}
		case OutcomeMissing:
			missing++
		default:
			return loaded, missing, fmt.Errorf("key %d: outcome %v", i, oc)
		}
	}
	return loaded, missing, nil
}

func blockBytesErr(e *Engine, id int) []byte {
	b := make([]byte, e.slot)
	segs, _ := e.layout.Segments(id, nil)
	for _, s := range segs {
		_ = e.sim.Read(s.Dev, b[s.Off:s.Off+s.Len])
	}
	return b
}

// runDialChild is a client process dialled to the node at socket: role
// "store" stores the keys of a seed, "load" loads and checks them, "hang"
// stores with copies that never finish and waits to be killed,
// "scheduler" dials without a GPU and looks them up.
func runDialChild(role, socket, args string) int {
	f := strings.Fields(args)
	seed, _ := strconv.Atoi(f[0])
	n, _ := strconv.Atoi(f[1])
	keys := dialKeys(seed, n)
	say := func(format string, a ...any) { fmt.Printf(format+"\n", a...) }
	var h engineHooks
	cfg := dialConfig()
	switch role {
	case "hang":
		sim, err := cudadev.NewSim(cudadev.SimConfig{MinDelay: time.Hour, MaxDelay: time.Hour})
		if err != nil {
			say("error %v", err)
			return 1
		}
		h.sim = sim
	case "scheduler":
		cfg = Config{Layout: smallLayout(dialBlocks), Namespace: "dialtest"}
		cfg.Layout.NumBlocks = 1
	case "loadhang":
		// A Load of disk blocks whose copies never finish, stopped
		// before it asks for its third chunk.
		sim, err := cudadev.NewSim(cudadev.SimConfig{MinDelay: time.Hour, MaxDelay: time.Hour})
		if err != nil {
			say("error %v", err)
			return 1
		}
		h.sim = sim
		h.beforeNodePromote = func(i int) {
			if i == 2 {
				say("promoting 2")
				select {}
			}
		}
	}
	e, err := dialEngine(socket, cfg, h)
	if err != nil {
		say("error %v", err)
		return 1
	}
	switch role {
	case "store":
		op, err := storeKeys(e, keys, StoreOptions{})
		if err != nil {
			say("error %v", err)
			return 1
		}
		out, err := waitOut(op)
		stored := 0
		for _, oc := range out {
			if oc == OutcomeStored {
				stored++
			}
		}
		say("stored %d %v", stored, err)
	case "load":
		l, m, err := loadVerify(e, keys)
		if err != nil {
			say("error %v", err)
			return 1
		}
		say("verified %d missing %d", l, m)
	case "hang":
		if _, err := storeKeys(e, keys, StoreOptions{}); err != nil {
			say("error %v", err)
			return 1
		}
		say("storing %d", n)
		select {}
	case "loadhang":
		_, err := e.Load(context.Background(), keys, seqIDs(dialBlocks/2, n), LoadOptions{})
		say("error: Load returned: %v", err)
		return 1
	case "scheduler":
		res, err := e.Lookup(keys, LookupOptions{Lease: true})
		if err != nil {
			say("error %v", err)
			return 1
		}
		if res.Lease != nil {
			if err := res.Lease.Release(); err != nil {
				say("error %v", err)
				return 1
			}
		}
		if _, err := e.Store(context.Background(), keys[:1], []int{0}, StoreOptions{}); !errors.Is(err, ErrInvalidArgument) {
			say("error Store without a GPU: %v", err)
			return 1
		}
		say("hits %d", res.Hits)
	}
	if err := e.Close(); err != nil {
		say("error close %v", err)
		return 1
	}
	return 0
}

type dialChild struct {
	cmd   *exec.Cmd
	lines chan string
}

func startDialChild(t *testing.T, role, socket string, seed, n int) *dialChild {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "KVO_DIAL_CHILD="+role, "KVO_DIAL_SOCKET="+socket, fmt.Sprintf("KVO_DIAL_ARGS=%d %d", seed, n),
		"GORACE="+strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
	return &dialChild{cmd: cmd, lines: startChild(t, cmd, 64)}
}

// startChild starts a child process (a test binary run again) whose
// stderr is the test's and returns its stdout's lines (closed at its end),
// buffered up to buf; the child is killed and reaped when t ends.
func startChild(t *testing.T, cmd *exec.Cmd, buf int) chan string {
	t.Helper()
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	lines := make(chan string, buf)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return lines
}

func (c *dialChild) expect(t *testing.T, want string) {
	t.Helper()
	select {
	case l, ok := <-c.lines:
		require.True(t, ok, "child ended before %q", want)
		require.Equal(t, want, l)
	case <-time.After(60 * time.Second):
		t.Fatalf("child silent, want %q", want)
	}
}

func (c *dialChild) wait(t *testing.T) {
	t.Helper()
	for range c.lines {
	}
	require.NoError(t, c.cmd.Wait())
}

func waitNode(t *testing.T, s *nodepool.Server, what string, ok func(nodepool.Stats) bool) nodepool.Stats {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		st := s.Stats()
		if ok(st) {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: node stats %+v", what, st)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestDialTwoProcesses: one process's engine stores through the node,
// another's loads the same keys byte for byte, and a third without a GPU
// (a scheduler) sees them with Lookup.
func TestDialTwoProcesses(t *testing.T) {
	s := startNode(t, filepath.Join(t.TempDir(), "node.sock"))
	w := startDialChild(t, "store", s.Addr(), 1, 24)
	w.expect(t, "stored 24 <nil>")
	w.wait(t)
	r := startDialChild(t, "load", s.Addr(), 1, 24)
	r.expect(t, "verified 24 missing 0")
	r.wait(t)
	c := startDialChild(t, "scheduler", s.Addr(), 1, 24)
	c.expect(t, "hits 24")
	c.wait(t)
	st := waitNode(t, s, "clients gone", func(st nodepool.Stats) bool { return st.Clients == 0 })
	require.Equal(t, 24, st.Cache.Ready)
	require.Zero(t, st.Cache.Leased)
	require.Zero(t, st.Cache.Writing)
}

// TestDialKillStoring: a storing process SIGKILLed with its copies in
// flight leaves no block of its keys ready; the other process loads
// exactly what was committed, and the keys can be stored again.
func TestDialKillStoring(t *testing.T) {
	s := startNode(t, filepath.Join(t.TempDir(), "node.sock"))
	w := startDialChild(t, "store", s.Addr(), 1, 16)
	w.expect(t, "stored 16 <nil>")
	w.wait(t)
	h := startDialChild(t, "hang", s.Addr(), 2, 16)
	h.expect(t, "storing 16")
	require.Equal(t, 16, s.Stats().Cache.Writing)
	require.NoError(t, h.cmd.Process.Signal(syscall.SIGKILL))
	st := waitNode(t, s, "release on exit", func(st nodepool.Stats) bool { return st.Cache.Writing == 0 })
	require.Equal(t, 16, st.Cache.Ready)
	r := startDialChild(t, "load", s.Addr(), 2, 16)
	r.expect(t, "verified 0 missing 16")
	r.wait(t)
	r = startDialChild(t, "load", s.Addr(), 1, 16)
	r.expect(t, "verified 16 missing 0")
	r.wait(t)
	w = startDialChild(t, "store", s.Addr(), 2, 16)
	w.expect(t, "stored 16 <nil>")
	w.wait(t)
	r = startDialChild(t, "load", s.Addr(), 2, 16)
	r.expect(t, "verified 16 missing 0")
	r.wait(t)
}

// TestDialNodeRestart: with the node gone, Lookup misses, Store refuses
// busy and Load fails with ErrUnavailable; once a node is back on the
// socket the engine reconnects, finds the new (empty) pool, and what it
// stores there it loads back.
func TestDialNodeRestart(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "node.sock")
	s := startNode(t, socket)
	e, err := Dial(socket, dialConfig())
	require.NoError(t, err)
	defer e.Close()
	keys := dialKeys(1, 8)
	op, err := storeKeys(e, keys, StoreOptions{})
	require.NoError(t, err)
	out, err := waitOut(op)
	require.NoError(t, err)
	require.Equal(t, []Outcome{OutcomeStored, OutcomeStored, OutcomeStored, OutcomeStored, OutcomeStored, OutcomeStored, OutcomeStored, OutcomeStored}, out)
	l, m, err := loadVerify(e, keys)
	require.NoError(t, err)
	require.Equal(t, [2]int{8, 0}, [2]int{l, m})
	require.Positive(t, e.Stats().Pool.Regions)

	require.NoError(t, s.Close())
	require.Eventually(t, func() bool { return e.Stats().Pool.Regions == 0 }, 20*time.Second, 5*time.Millisecond, "the lost node's regions retired")
	res, err := e.Lookup(keys, LookupOptions{Lease: true})
	require.NoError(t, err)
	require.Zero(t, res.Hits)
	require.Nil(t, res.Lease)
	op, err = storeKeys(e, dialKeys(2, 4), StoreOptions{})
	require.NoError(t, err)
	out, err = waitOut(op)
	require.NoError(t, err)
	require.Equal(t, []Outcome{OutcomeRefusedBusy, OutcomeRefusedBusy, OutcomeRefusedBusy, OutcomeRefusedBusy}, out)
	_, _, err = loadVerify(e, keys)
	require.ErrorIs(t, err, ErrUnavailable)

	startNode(t, socket)
	keys2 := dialKeys(3, 8)
	require.Eventually(t, func() bool {
		op, err := storeKeys(e, keys2, StoreOptions{})
		if err != nil {
			return false
		}
		out, _ := waitOut(op)
		return out[0] == OutcomeStored
	}, 20*time.Second, 20*time.Millisecond, "stores again once the node is back")
	res, err = e.Lookup(keys, LookupOptions{})
	require.NoError(t, err)
	require.Zero(t, res.Hits, "the new node's pool is empty")
	l, m, err = loadVerify(e, keys2)
	require.NoError(t, err)
	require.Equal(t, [2]int{8, 0}, [2]int{l, m})
	l, m, err = loadVerify(e, keys)
	require.NoError(t, err)
	require.Equal(t, [2]int{0, 8}, [2]int{l, m})
	if e.tracker != nil { // invariant builds: every copy was on a live region
		require.Empty(t, e.tracker.Violations())
	}
}

// TestDialSchedulerEvents: a client without a GPU sees the blocks another
// engine stores through the node (Lookup, leases, events) and cannot
// store or load.
func TestDialSchedulerEvents(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "node.sock")
	startNode(t, socket)
	g, err := Dial(socket, dialConfig())
	require.NoError(t, err)
	defer g.Close()
	sc, err := Dial(socket, Config{Layout: smallLayout(dialBlocks), Namespace: "dialtest"})
	require.NoError(t, err)
	defer sc.Close()
	ev := sc.Events(0)
	keys := dialKeys(1, 4)
	op, err := storeKeys(g, keys, StoreOptions{})
	require.NoError(t, err)
	_, err = waitOut(op)
	require.NoError(t, err)
	for i := range keys {
		select {
		case e := <-ev.C:
			require.Equal(t, EventStored, e.Kind)
			require.Equal(t, keys[i], e.Key)
		case <-time.After(10 * time.Second):
			t.Fatalf("event %d not received", i)
		}
	}
	res, err := sc.Lookup(keys, LookupOptions{Lease: true})
	require.NoError(t, err)
	require.Equal(t, 4, res.Hits)
	_, err = sc.Load(context.Background(), keys, []int{0, 1, 2, 3}, LoadOptions{Lease: res.Lease})
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.NoError(t, res.Lease.Release())
	st := sc.Stats()
	require.EqualValues(t, 4, st.Pool.BlocksReady)
	require.Zero(t, st.Pool.BlocksLeased)
	require.Zero(t, st.Pool.Regions, "no GPU: no region mapped")
	n, err := sc.Delete(keys[:1])
	require.NoError(t, err)
	require.Equal(t, 1, n)
	select {
	case e := <-ev.C:
		require.Equal(t, EventRemoved, e.Kind)
		require.Equal(t, keys[0], e.Key)
	case <-time.After(10 * time.Second):
		t.Fatal("removal event not received")
	}
	require.Error(t, g.GrowTo(1<<30))
}

// TestDialLeaseAcrossNodeLoss: a lease taken before the node went away
// cannot be loaded from once the node's regions retired here: the Load
// fails with ErrUnavailable (and the lease is the caller's again), never
// copies from memory this process unmapped.
func TestDialLeaseAcrossNodeLoss(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "node.sock")
	s := startNode(t, socket)
	e, err := Dial(socket, dialConfig())
	require.NoError(t, err)
	defer e.Close()
	keys := dialKeys(1, 4)
	op, err := storeKeys(e, keys, StoreOptions{})
	require.NoError(t, err)
	_, err = waitOut(op)
	require.NoError(t, err)
	res, err := e.Lookup(keys, LookupOptions{Lease: true})
	require.NoError(t, err)
	require.Equal(t, 4, res.Hits)
	require.NoError(t, s.Close())
	require.Eventually(t, func() bool { return e.Stats().Pool.Regions == 0 }, 20*time.Second, 5*time.Millisecond)
	_, err = e.Load(context.Background(), keys, []int{40, 41, 42, 43}, LoadOptions{Lease: res.Lease})
	require.ErrorIs(t, err, ErrUnavailable)
	require.NoError(t, res.Lease.Release())
}

// TestDialTrim: Engine.Trim of an engine of Dial trims the node's pool:
// every engine dialled to it unpins and forgets the retired region, and
// both keep storing and loading in what is left.
func TestDialTrim(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "node.sock")
	s := startNode(t, socket)
	a, err := Dial(socket, dialConfig())
	require.NoError(t, err)
	defer a.Close()
	b, err := Dial(socket, dialConfig())
	require.NoError(t, err)
	defer b.Close()
	require.Eventually(t, func() bool { return a.Stats().Pool.Regions == 2 && b.Stats().Pool.Regions == 2 }, 20*time.Second, 5*time.Millisecond)
	res, err := a.Trim(context.Background(), 1)
	require.NoError(t, err)
	require.Equal(t, 1, res.Regions)
	require.Eventually(t, func() bool {
		return a.Stats().Pool.Regions == 1 && b.Stats().Pool.Regions == 1 && s.Stats().Regions == 1
	}, 20*time.Second, 5*time.Millisecond, "the region retired in both engines and on the node")
	require.EqualValues(t, 1<<20, a.Stats().Pool.OwnedBytes)
	keys := dialKeys(5, 8)
	op, err := storeKeys(a, keys, StoreOptions{})
	require.NoError(t, err)
	out, err := waitOut(op)
	require.NoError(t, err)
	require.Equal(t, 8, countOutcome(out, OutcomeStored))
	l, m, err := loadVerify(b, keys)
	require.NoError(t, err)
	require.Equal(t, [2]int{8, 0}, [2]int{l, m})
}

func countOutcome(out []Outcome, oc Outcome) int {
	n := 0
	for _, o := range out {
		if o == oc {
			n++
		}
	}
	return n
}

// TestDialTPSizeSharing: the two ranks of TP=2, each its own dialled
// engine, store their heads of the same blocks through one node; the
// blocks are invisible until the second rank's heads are in; then a TP=1
// engine and a TP=4 rank load them byte-exact, each its heads only.
func TestDialTPSizeSharing(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "node.sock")
	startNode(t, socket)
	dialTP := func(tp, r int) *Engine {
		t.Helper()
		e, err := Dial(socket, Config{Backend: BackendHost, Layout: tpLayout(tp, r), PrefaultThreads: 1, StagingBytes: -1, Namespace: "model-x"})
		require.NoError(t, err)
		t.Cleanup(func() { _ = e.Close() })
		return e
	}
	ranks := []*Engine{dialTP(2, 0), dialTP(2, 1)}
	one, quarter := dialTP(1, 0), dialTP(4, 3)
	const n = 3
	var keys []Key
	for j := range n {
		keys = append(keys, testKey(300+j))
	}
	ids := [][]int{{3, 5, 0}, {1, 2, 7}}
	for r, e := range ranks {
		for j := range n {
			tpWrite(t, e, e.Config().Layout, ids[r][j], j)
		}
	}
	oc := tpRun(t)(ranks[0].Store(context.Background(), keys, ids[0], StoreOptions{}))
	require.Equal(t, repeatOutcome(OutcomeStored, n), oc)
	res, err := one.Lookup(keys, LookupOptions{})
	require.NoError(t, err)
	require.Zero(t, res.Hits, "a block missing rank 1's heads is invisible through the node")
	oc = tpRun(t)(ranks[1].Store(context.Background(), keys, ids[1], StoreOptions{}))
	require.Equal(t, repeatOutcome(OutcomeStored, n), oc, "rank 1's heads are a write into the same slots")
	dst := []int{6, 4, 2}
	for name, e := range map[string]*Engine{"TP=1": one, "TP=4 rank 3": quarter} {
		l := e.Config().Layout
		tpPoison(t, e, l)
		oc = tpRun(t)(e.Load(context.Background(), keys, dst, LoadOptions{}))
		require.Equal(t, repeatOutcome(OutcomeLoaded, n), oc, name)
		for j, id := range dst {
			tpCheck(t, e, l, id, j, name+" through the node")
		}
	}
}

// TestDialNodeDisk: an engine dialled to a node with a disk tier sees the
// blocks the node's pool evicted as DiskHits of Lookup (in the lookup's
// round trip), and its Load gets them byte-exact: the node promotes them
// from disk into pool slots, the engine copies them from there.
func TestDialNodeDisk(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "node.sock")
	// 64 slots of 8 KiB for 128 blocks; every block stored once, so
	// written through (the default writes back only blocks seen twice).
	s := startNodeConfig(t, nodepool.ServerConfig{Socket: socket, PoolBytes: 512 << 10, RegionBytes: 512 << 10, PrefaultThreads: 1,
		Disk: &tiered.DiskConfig{Dirs: []string{t.TempDir()}, CapacityBytes: 4 << 20, WriteThrough: true}})
	w, err := Dial(socket, dialConfig())
	require.NoError(t, err)
	defer w.Close()
	var all []Key
	for b := range 4 {
		keys := dialKeys(b+1, 32)
		op, err := storeKeys(w, keys, StoreOptions{})
		require.NoError(t, err)
		out, err := waitOut(op)
		require.NoError(t, err)
		for i, oc := range out {
			require.Equal(t, OutcomeStored, oc, "batch %d key %d", b, i)
		}
		all = append(all, keys...)
		waitNode(t, s, "write-through", func(st nodepool.Stats) bool { return st.DiskWrites == int64(len(all)) })
	}
	require.Positive(t, s.Stats().Cache.Evicted)

	r, err := Dial(socket, dialConfig())
	require.NoError(t, err)
	defer r.Close()
	first := all[:32]
	res, err := r.Lookup(first, LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 0, res.Hits, "the first batch left the pool")
	require.Equal(t, 32, res.DiskHits, "and is on the node's disk")
	loaded, missing, err := loadVerify(r, first)
	require.NoError(t, err)
	require.Equal(t, 32, loaded)
	require.Zero(t, missing)
	st := s.Stats()
	require.EqualValues(t, 32, st.DiskHits)
	require.Zero(t, st.DiskMisses)
	require.EqualValues(t, 32, r.Stats().Disk.LookupHits)
}
