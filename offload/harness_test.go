package offload

import (
	"context"
	"errors"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/kvoffload/kvoffload/transfer"
)

// keyContent is the content every test stores under k: a pure function of
// the key, so that any load can be checked without remembering who stored.
func keyContent(k Key, n int64) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = k[i%16] ^ byte(i/16) ^ byte(i/4096)*29
	}
	return b
}

// testKey is the i-th key of a test's key universe.
func testKey(i int) Key {
	var k Key
	k[0], k[1], k[2], k[15] = byte(i), byte(i>>8), 0x5A, 0xC3
	return k
}

// errorer is what writeBlock needs of a *testing.T or *rapid.T.
type errorer interface{ Error(args ...any) }

// writeBlock places content in GPU block id, segment by segment.
func writeBlock(t errorer, e *Engine, id int, content []byte) {
	segs, err := e.layout.Segments(id, nil)
	if err != nil {
		t.Error(err)
		return
	}
	for _, s := range segs {
		if err := e.sim.Write(s.Dev, content[s.Off:s.Off+s.Len]); err != nil {
			t.Error(err)
		}
	}
}

// simLayout allocates smallLayout(blocks)'s tensors in sim (so that the
// test, not the engine, owns the "GPU" memory and can read it after Close).
func simLayout(t testing.TB, sim *cudadev.Sim, blocks int) LayoutSpec {
	l := smallLayout(blocks)
	seg := uint64(l.KVHeads * l.HeadDim * l.DTypeBytes * l.TokensPerBlock)
	for range l.Layers {
		k, err := sim.MemAlloc(seg * uint64(blocks))
		require.NoError(t, err)
		v, err := sim.MemAlloc(seg * uint64(blocks))
		require.NoError(t, err)
		l.LayerTensors = append(l.LayerTensors, LayerTensors{K: k, V: v, Stride: seg})
	}
	return l
}

// tally counts what the workers saw.
type tally struct {
	mu       sync.Mutex
	outcomes [numOutcomes]int64
	ops      [3]int64 // by transfer.Direction
	loaded   int64    // loaded blocks checked byte for byte
	busy     int64    // Loads refused with ErrBusy
}

func (ta *tally) add(op *Op, out []Outcome) {
	ta.mu.Lock()
	defer ta.mu.Unlock()
	ta.ops[op.Kind()]++
	for _, oc := range out {
		ta.outcomes[oc]++
	}
}

// worker drives one goroutine's share of a stress test: stores, loads (with
// and without leases), lookups and deletes over a shared key universe,
// into GPU blocks it alone owns. It returns when stop is closed or the
// engine is closed, and fails the test on any wrong byte or bad outcome.
type worker struct {
	t      testing.TB
	e      *Engine
	blocks []int // the GPU block ids this worker owns
	keys   int   // size of the key universe
	rng    *rand.Rand
	ta     *tally
	count  *atomic.Int64 // ops done, all workers
}

func (w *worker) run(stop <-chan struct{}) {
	for {
		select {
		case <-stop:
			return
		default:
		}
		var err error
		switch r := w.rng.IntN(10); {
		case r < 4:
			err = w.store()
		case r < 8:
			err = w.load(r == 7)
		case r == 8:
			_, err = w.e.Lookup(w.pick(4), LookupOptions{})
		default:
			_, err = w.e.Delete(w.pick(1))
		}
		if errors.Is(err, ErrClosed) {
			return
		}
		if err != nil {
			w.t.Errorf("worker: %v", err)
			return
		}
		w.count.Add(1)
		// Yield between ops, as a caller interleaving its own work would.
		// An op that finds nothing to do (every store refused, every load
		// missing) returns without blocking, so without a yield the
		// workers keep every P busy for whole preemption slices (10 ms)
		// while the goroutines that finish copies (the simulation's
		// streams, the completion poller, growth) wait behind them on
		// their timers: at GOMAXPROCS=1 a worker could do a thousand ops
		// per copy, deleting every block while it is still being written,
		// so no block ever became ready.
		runtime.Gosched()
	}
}

// pick returns up to n distinct keys of the universe.
func (w *worker) pick(n int) []Key {
	n = 1 + w.rng.IntN(n)
	seen := map[int]bool{}
	var keys []Key
	for len(keys) < n {
		i := w.rng.IntN(w.keys)
		if !seen[i] {
			seen[i] = true
			keys = append(keys, testKey(i))
		}
	}
	return keys
}

func (w *worker) ctx() context.Context {
	if w.rng.IntN(20) == 0 {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		return ctx
	}
	return context.Background()
}

func (w *worker) finish(op *Op) ([]Outcome, error) {
	if err := op.Wait(context.Background()); err != nil {
		return nil, err
	}
	out, err := op.Outcomes()
	if err != nil {
		return nil, err
	}
	for i, oc := range out {
		if oc == OutcomePending || oc >= numOutcomes {
			w.t.Errorf("%s block %d: outcome %v after Done", op.Kind(), i, oc)
		}
	}
	w.ta.add(op, out)
	return out, op.Release()
}

func (w *worker) store() error {
	keys := w.pick(min(4, len(w.blocks)))
	ids := w.blocks[:len(keys)]
	for i, k := range keys {
		writeBlock(w.t, w.e, ids[i], keyContent(k, w.e.slot))
	}
	op, err := w.e.Store(w.ctx(), keys, ids, StoreOptions{})
	if err != nil {
		return err
	}
	for i, oc := range mustOutcomes(w.finish(op)) {
		switch oc {
		case OutcomeStored, OutcomeAlreadyPresent, OutcomeRefusedFull, OutcomeRefusedBusy,
			OutcomeRefusedAdmission, OutcomeCancelled:
		default:
			w.t.Errorf("store of key %v: outcome %v", keys[i], oc)
		}
	}
	return nil
}

func mustOutcomes(out []Outcome, _ error) []Outcome { return out }

func (w *worker) load(withLease bool) error {
	keys := w.pick(min(4, len(w.blocks)))
	ids := w.blocks[:len(keys)]
	junk := make([]byte, w.e.slot)
	for _, id := range ids {
		writeBlock(w.t, w.e, id, junk)
	}
	var opts LoadOptions
	if withLease {
		res, err := w.e.Lookup(keys, LookupOptions{Lease: true})
		if err != nil {
			return err
		}
		opts.Lease = res.Lease
	}
	op, err := w.e.Load(w.ctx(), keys, ids, opts)
	if errors.Is(err, ErrBusy) {
		w.ta.mu.Lock()
		w.ta.busy++
		w.ta.mu.Unlock()
		if opts.Lease != nil {
			return opts.Lease.Release()
		}
		return nil
	}
	if err != nil {
		if opts.Lease != nil {
			_ = opts.Lease.Release()
		}
		return err
	}
	out, err := w.finish(op)
	if err != nil {
		return err
	}
	if opts.Lease != nil {
		if err := opts.Lease.Release(); !errors.Is(err, ErrReleased) {
			w.t.Errorf("Load did not take the lease over: Release returned %v", err)
		}
		for i := range opts.Lease.keys {
			if out[i] == OutcomeMissing {
				w.t.Errorf("leased key %v reported missing", keys[i])
			}
		}
	}
	for i, oc := range out {
		switch oc {
		case OutcomeLoaded:
			got := blockBytes(w.e, ids[i])
			if want := keyContent(keys[i], w.e.slot); string(got) != string(want) {
				w.t.Errorf("load of key %v into block %d: bytes differ from what was stored", keys[i], ids[i])
			}
			w.ta.mu.Lock()
			w.ta.loaded++
			w.ta.mu.Unlock()
		case OutcomeMissing, OutcomeCancelled:
		default:
			w.t.Errorf("load of key %v: outcome %v", keys[i], oc)
		}
	}
	return nil
}

// startWorkers starts n workers over disjoint blocks of e's layout.
func startWorkers(t testing.TB, e *Engine, n, keys int, seed uint64, ta *tally, count *atomic.Int64, stop <-chan struct{}) *sync.WaitGroup {
	per := e.cfg.Layout.NumBlocks / n
	var wg sync.WaitGroup
	for i := range n {
		blocks := make([]int, per)
		for j := range blocks {
			blocks[j] = i*per + j
		}
		w := &worker{t: t, e: e, blocks: blocks, keys: keys, rng: rand.New(rand.NewPCG(seed, uint64(i))), ta: ta, count: count}
		wg.Add(1)
		go func() {
			defer wg.Done()
			w.run(stop)
		}()
	}
	return &wg
}

// checkTally asserts that the engine's counters equal what the workers saw.
func checkTally(t *testing.T, st Stats, ta *tally) {
	t.Helper()
	ta.mu.Lock()
	defer ta.mu.Unlock()
	require.Equal(t, int64(0), st.Outcomes[OutcomePending], "no block left pending")
	require.Equal(t, ta.outcomes, st.Outcomes, "outcome counters equal the outcomes the ops reported")
	require.Equal(t, ta.ops[transfer.Store], st.Copies.Store.Ops)
	require.Equal(t, ta.ops[transfer.Load], st.Copies.Load.Ops)
	require.Equal(t, ta.outcomes[OutcomeStored], st.Copies.Store.Blocks)
	require.Equal(t, ta.outcomes[OutcomeLoaded], st.Copies.Load.Blocks)
	require.Equal(t, st.Copies.Store.Blocks*st.Pool.BlockBytes, st.Copies.Store.Bytes)
	require.Equal(t, st.Copies.Load.Blocks*st.Pool.BlockBytes, st.Copies.Load.Bytes)
	require.Equal(t, st.Copies.Store.Ops, st.Copies.Store.Latency.Count)
	require.Equal(t, st.Copies.Load.Ops, st.Copies.Load.Latency.Count)
	require.Equal(t, ta.outcomes[OutcomeLoaded], ta.loaded)
}

// gatedEvent returns an event recorded on a new caller stream of sim that
// waits at a gate, the stream, and the gate's opener (idempotent; defer it
// before the engine's Close runs, which waits for the copies): a store
// given the event as StoreOptions.After stays in flight until open is
// called.
func gatedEvent(t *testing.T, sim *cudadev.Sim) (ev transfer.Event, cs transfer.Stream, open func()) {
	t.Helper()
	cs = sim.NewStream()
	openGate, err := sim.Gate(cs)
	require.NoError(t, err)
	open = sync.OnceFunc(openGate)
	ev, err = sim.CreateEvent(false)
	require.NoError(t, err)
	require.NoError(t, sim.RecordEvent(ev, cs))
	return ev, cs, open
}
