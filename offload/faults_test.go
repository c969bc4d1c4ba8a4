package offload

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
)

// Faults end to end through the public API over the fake driver (issue
// 10). Each test injects one fault and asserts the exact outcome: the ops
// it affects fail with the driver's error, every block stored before stays
// readable byte for byte, and nothing leaks (fakeDriver's cleanup checks
// the fake's Live counts and goleak; requireSettled checks that no slot is
// stuck writing or releasing).

// requireSettled checks, with no op in flight, that no copy is counted in
// flight, that the cache's invariants hold and that no slot is stuck in a
// transient state.
func requireSettled(t *testing.T, e *Engine) {
	t.Helper()
	st := e.Stats()
	require.Zero(t, st.Copies.InFlightBytes, "no copy counted in flight")
	require.Zero(t, st.Pool.BlocksLeased, "no block left leased")
	require.NoError(t, e.kc.Verify())
	cs := e.cache.Stats()
	require.Zero(t, cs.Writing, "no slot stuck writing")
	require.Zero(t, cs.Releasing, "no slot stuck releasing")
	require.Equal(t, st.Pool.SlotsTotal, st.Pool.SlotsFree+st.Pool.BlocksReady, "every slot is free or ready")
}

// faultEngine is a CUDA engine over d with a layer-separate layout of 64
// blocks (8 KiB each) and a pool of 64 slots in regions of 16.
func faultEngine(t *testing.T, d *cudafake.Driver, g *gpuMem, method cudacopy.Method) *Engine {
	t.Helper()
	slot := int64(8 << 10)
	e, err := newCUDAEngine(t, d, Config{PoolBytes: 64 * slot, FirstRegionBytes: 16 * slot, RegionBytes: 16 * slot,
		Layout: g.layout(LayoutLayerSeparate, 64), Policy: PolicyLRU}, engineHooks{copyOptions: cudacopy.Options{Method: method}})
	require.NoError(t, err)
	require.NoError(t, e.WaitGrown(context.Background()))
	return e
}

// storeContents writes contents into GPU blocks ids and stores them under keys.
func storeContents(t *testing.T, e *Engine, g *gpuMem, keys []Key, ids []int, contents [][]byte) {
	t.Helper()
	for i, id := range ids {
		g.write(e, id, contents[i])
	}
	storeAll(t, e, keys, ids, StoreOptions{})
}

func seqKeys(from, n int) []Key {
	keys := make([]Key, n)
	for i := range keys {
		keys[i] = testKey(from + i)
	}
	return keys
}

func seqIDs(from, n int) []int {
	ids := make([]int, n)
	for i := range ids {
		ids[i] = from + i
	}
	return ids
}

// TestFaultEventNeverCompletes: the event of a Load never completes. Its
// Wait with a deadline returns the context's error and the op stays
// pending; the other direction keeps working (a Store completes and is
// visible); Close bounded by a context gives up with the context's error,
// the engine refuses new calls, and it finishes releasing once the device
// reports the copy (here: when the driver is torn down).
func TestFaultEventNeverCompletes(t *testing.T) {
	d := cudafake.New(cudafake.Options{CheckContext: true})
	g := newGPUMem(t, d, 8<<10)
	e := faultEngine(t, d, g, cudacopy.MethodMemcpy)
	rng := rand.New(rand.NewPCG(10, 1))
	contents := randomContents(rng, 4, e.slot)
	storeContents(t, e, g, seqKeys(0, 4), seqIDs(0, 4), contents)

	// A load records two events (the op's and its batch's): neither completes.
	d.HangAt(cuda.OpEventRecord, d.Calls(cuda.OpEventRecord)+1)
	d.HangAt(cuda.OpEventRecord, d.Calls(cuda.OpEventRecord)+2)
	hung, err := e.Load(context.Background(), seqKeys(0, 2), []int{40, 41}, LoadOptions{})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	require.ErrorIs(t, hung.Wait(ctx), context.DeadlineExceeded)
	cancel()
	_, err = hung.Outcomes()
	require.ErrorIs(t, err, ErrNotDone)

	more := randomContents(rng, 2, e.slot)
	storeContents(t, e, g, seqKeys(10, 2), []int{4, 5}, more)
	res, err := e.Lookup(append(seqKeys(0, 4), seqKeys(10, 2)...), LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 6, res.Hits, "stores still complete while a load's event hangs")

	ctx, cancel = context.WithTimeout(context.Background(), 50*time.Millisecond)
	err = e.CloseContext(ctx)
	cancel()
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorContains(t, err, "copies in flight")
	_, err = e.Store(context.Background(), seqKeys(20, 1), []int{6}, StoreOptions{})
	require.ErrorIs(t, err, ErrClosed)
	require.ErrorIs(t, e.Close(), ErrClosed)

	g.close()
	// Tearing the driver down fails the hung event; the background Close
	// then finishes and every engine goroutine ends.
	require.NoError(t, d.Close())
	<-hung.Done()
	require.Equal(t, []Outcome{OutcomeFailed, OutcomeFailed}, mustOutcomes(hung.Outcomes()))
	goleak.VerifyNone(t)
}

// TestFaultOutOfOrderCompletions: stores and loads interleaved, several of
// each in flight at once, every queued work item delayed at random so that
// completions arrive out of order across the streams, for each copy
// method: every load is byte-exact and every store lands.
func TestFaultOutOfOrderCompletions(t *testing.T) {
	for _, m := range []cudacopy.Method{cudacopy.MethodMemcpy, cudacopy.MethodBatch, cudacopy.MethodKernel} {
		t.Run(fmt.Sprint(m), func(t *testing.T) {
			d := fakeDriver(t, cudafake.Options{Seed: uint64(m) + 7, MaxDelay: 300 * time.Microsecond})
			g := newGPUMem(t, d, 8<<10)
			defer g.close()
			e := faultEngine(t, d, g, m)
			rng := rand.New(rand.NewPCG(uint64(m), 2))
			stored := map[Key][]byte{}
			var storedKeys []Key
			next := 0
			for round := range 6 {
				// Four stores of two blocks each from GPU blocks 0..7.
				var stores []*Op
				var newKeys []Key
				for s := range 4 {
					keys := seqKeys(1000*round+next, 2)
					next += 2
					ids := []int{2 * s, 2*s + 1}
					c := randomContents(rng, 2, e.slot)
					for i, id := range ids {
						g.write(e, id, c[i])
						stored[keys[i]] = c[i]
					}
					op, err := e.Store(context.Background(), keys, ids, StoreOptions{})
					require.NoError(t, err)
					stores = append(stores, op)
					newKeys = append(newKeys, keys...)
				}
				// Meanwhile, loads of earlier keys into blocks 16..63, one
				// destination per block.
				type pending struct {
					op   *Op
					keys []Key
					ids  []int
				}
				var loads []pending
				dst := 16
				for l := 0; l < 6 && len(storedKeys) > 0; l++ {
					n := 1 + rng.IntN(3)
					keys := make([]Key, 0, n)
					seen := map[Key]bool{}
					for range n {
						k := storedKeys[rng.IntN(len(storedKeys))]
						if !seen[k] {
							seen[k] = true
							keys = append(keys, k)
						}
					}
					ids := seqIDs(dst, len(keys))
					dst += len(keys)
					op, err := e.Load(context.Background(), keys, ids, LoadOptions{})
					require.NoError(t, err)
					loads = append(loads, pending{op, keys, ids})
				}
				for _, op := range stores {
					require.NoError(t, op.Wait(context.Background()))
					require.Equal(t, 2, op.count(OutcomeStored))
					require.NoError(t, op.Release())
				}
				for _, p := range loads {
					require.NoError(t, p.op.Wait(context.Background()))
					require.Equal(t, len(p.keys), p.op.count(OutcomeLoaded), "the pool of 64 slots holds the 48 keys of the test")
					for i, id := range p.ids {
						require.Equal(t, stored[p.keys[i]], g.read(e, id), "round %d: block %d loaded from key %v", round, id, p.keys[i])
					}
					require.NoError(t, p.op.Release())
				}
				storedKeys = append(storedKeys, newKeys...)
			}
			requireSettled(t, e)
			require.NoError(t, e.Close())
		})
	}
}

// TestFaultDeviceOutOfMemory: device memory holds the stack's KV cache and
// nothing more, so the copy kernels' descriptor buffers cannot be
// allocated: New fails with the driver's out-of-memory error and leaves
// nothing allocated, registered, created or running.
func TestFaultDeviceOutOfMemory(t *testing.T) {
	d := fakeDriver(t, cudafake.Options{DeviceMemory: 2 * 2 * 2048 * 16})
	g := newGPUMem(t, d, 8<<10)
	defer g.close()
	e, err := newCUDAEngine(t, d, Config{PoolBytes: 64 << 10, Layout: g.layout(LayoutLayerSeparate, 16)},
		engineHooks{copyOptions: cudacopy.Options{Method: cudacopy.MethodKernel}})
	require.Nil(t, e)
	require.ErrorContains(t, err, "CUDA_ERROR_OUT_OF_MEMORY")
	require.Equal(t, 0, d.Live().Registrations, "no host region left registered")
	require.Equal(t, 0, d.Live().Streams, "no stream left")
}

// TestFaultNoDriver: libcuda.so.1 missing. Backend "cuda" fails with
// ErrNoDriver naming the cause; "auto" falls back to the host backend and
// says why, and that engine works.
func TestFaultNoDriver(t *testing.T) {
	defer goleak.VerifyNone(t)
	missing := func() (cuda.Driver, error) {
		return nil, fmt.Errorf("%w: dlopen libcuda.so.1: cannot open shared object file", cuda.ErrNoDriver)
	}
	layout := LayoutSpec{Kind: LayoutCrossLayer, Layers: 2, KVHeads: 1, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16,
		NumBlocks: 4, Base: 1 << 30, Stride: 8 << 10}
	e, err := newEngine(Config{PoolBytes: 64 << 10, Layout: layout, Backend: BackendCUDA, SkipMemoryCheck: true},
		engineHooks{loadDriver: loader(missing)})
	require.Nil(t, e)
	require.ErrorIs(t, err, ErrNoDriver)
	require.ErrorContains(t, err, "libcuda.so.1")

	e, err = newEngine(Config{PoolBytes: 64 << 10, Layout: smallLayout(4), Backend: BackendAuto, SkipMemoryCheck: true},
		engineHooks{loadDriver: loader(missing)})
	require.NoError(t, err)
	name, reason := e.Backend()
	require.Equal(t, BackendHost, name)
	require.Contains(t, reason, "CUDA unavailable")
	require.Contains(t, reason, "libcuda.so.1")
	want := fillBlock(t, e, 0, 3)
	op, err := e.Store(context.Background(), []Key{testKey(1)}, []int{0}, StoreOptions{})
	require.NoError(t, err)
	require.NoError(t, op.Wait(context.Background()))
	op, err = e.Load(context.Background(), []Key{testKey(1)}, []int{1}, LoadOptions{})
	require.NoError(t, err)
	require.NoError(t, op.Wait(context.Background()))
	require.Equal(t, want, blockBytes(e, 1))
	require.NoError(t, e.Close())
}

// TestFaultCopyLaunchFails: the launch of a copy (cuLaunchKernel,
// cuMemcpyBatchAsync or cuMemcpyAsync, per method) fails once for a Store
// and once for a Load. Each affected op fails (or its call returns) with
// the driver's error; no block of the failed store becomes visible; every
// block stored before loads byte-exact; later ops work.
func TestFaultCopyLaunchFails(t *testing.T) {
	for _, tc := range []struct {
		method cudacopy.Method
		op     string
	}{
		{cudacopy.MethodKernel, cuda.OpLaunchKernel},
		{cudacopy.MethodBatch, cuda.OpMemcpyBatchAsync},
		{cudacopy.MethodMemcpy, cuda.OpMemcpyAsync},
	} {
		t.Run(tc.op, func(t *testing.T) {
			d := fakeDriver(t, cudafake.Options{})
			g := newGPUMem(t, d, 8<<10)
			defer g.close()
			e := faultEngine(t, d, g, tc.method)
			rng := rand.New(rand.NewPCG(3, uint64(tc.method)))
			contents := randomContents(rng, 6, e.slot)
			keys := seqKeys(0, 6)
			storeContents(t, e, g, keys[:4], seqIDs(0, 4), contents[:4])

			for i := 4; i < 6; i++ {
				g.write(e, i, contents[i])
			}
			d.FailAt(tc.op, d.Calls(tc.op)+1, cuda.ErrorInvalidValue)
			op, err := e.Store(context.Background(), keys[4:], []int{4, 5}, StoreOptions{})
			require.NoError(t, err)
			require.ErrorContains(t, op.Wait(context.Background()), "CUDA_ERROR_INVALID_VALUE")
			require.Equal(t, []Outcome{OutcomeFailed, OutcomeFailed}, mustOutcomes(op.Outcomes()))
			require.NoError(t, op.Release())
			res, err := e.Lookup(keys, LookupOptions{})
			require.NoError(t, err)
			require.Equal(t, 4, res.Hits, "no block of the failed store is visible")

			d.FailAt(tc.op, d.Calls(tc.op)+1, cuda.ErrorInvalidValue)
			op, err = e.Load(context.Background(), keys[:2], []int{20, 21}, LoadOptions{})
			loadFailed := 0
			if err == nil {
				loadFailed = 2
				err = op.Wait(context.Background())
				require.Equal(t, []Outcome{OutcomeFailed, OutcomeFailed}, mustOutcomes(op.Outcomes()))
				require.NoError(t, op.Release())
			}
			require.ErrorContains(t, err, "CUDA_ERROR_INVALID_VALUE")

			require.NoError(t, loadCheck(t, e, g, keys[:4], seqIDs(30, 4), contents[:4], LoadOptions{}).Release())
			storeAll(t, e, keys[4:], []int{4, 5}, StoreOptions{})
			require.NoError(t, loadCheck(t, e, g, keys, seqIDs(40, 6), contents, LoadOptions{}).Release())
			requireSettled(t, e)
			st := e.Stats()
			require.Equal(t, int64(2+loadFailed), st.Outcome(OutcomeFailed), "exactly the affected blocks failed")
			require.NoError(t, e.Close())
		})
	}
}

// TestFaultRegistrationDuringGrowth: blocks are stored while growth is
// held before the second region; then registering that region fails. The
// failed region is released, growth stops with the driver's error, and
// every block stored before loads byte-exact; the engine goes on storing
// into the regions it has.
func TestFaultRegistrationDuringGrowth(t *testing.T) {
	d := fakeDriver(t, cudafake.Options{})
	g := newGPUMem(t, d, 8<<10)
	defer g.close()
	slot := int64(8 << 10)
	hold := make(chan struct{})
	e, err := newCUDAEngine(t, d, Config{PoolBytes: 32 * slot, FirstRegionBytes: 8 * slot, RegionBytes: 8 * slot,
		Layout: g.layout(LayoutLayerSeparate, 64), Policy: PolicyLRU},
		engineHooks{beforeGrow: func(i int) {
			if i == 1 {
				<-hold
			}
		}})
	require.NoError(t, err)
	rng := rand.New(rand.NewPCG(4, 4))
	contents := randomContents(rng, 8, slot)
	keys := seqKeys(0, 8)
	storeContents(t, e, g, keys[:6], seqIDs(0, 6), contents[:6])
	regs := d.Live().Registrations
	d.FailAt(cuda.OpMemHostRegister, d.Calls(cuda.OpMemHostRegister)+1, cuda.ErrorOutOfMemory)
	close(hold)
	err = e.WaitGrown(context.Background())
	require.ErrorContains(t, err, "CUDA_ERROR_OUT_OF_MEMORY")
	require.Equal(t, regs, d.Live().Registrations, "the failed region left nothing registered")
	st := e.Stats()
	require.Equal(t, 1, st.Pool.Regions)
	require.Contains(t, st.Pool.GrowthError, "CUDA_ERROR_OUT_OF_MEMORY")
	require.NoError(t, loadCheck(t, e, g, keys[:6], seqIDs(20, 6), contents[:6], LoadOptions{}).Release())
	storeContents(t, e, g, keys[6:], []int{6, 7}, contents[6:])
	require.NoError(t, loadCheck(t, e, g, keys, seqIDs(40, 8), contents, LoadOptions{}).Release())
	requireSettled(t, e)
	require.NoError(t, e.Close())
}

// TestFaultStickyDuringLoad: a sticky error raised by a load's copy when
// its stream reaches it (not at the call) fails that load and makes the
// engine refuse new work with ErrDeviceLost naming the driver's error.
func TestFaultStickyDuringLoad(t *testing.T) {
	d := cudafake.New(cudafake.Options{CheckContext: true})
	t.Cleanup(func() {
		require.NoError(t, d.Close())
		goleak.VerifyNone(t)
	})
	g := newGPUMem(t, d, 8<<10)
	defer runtime.UnlockOSThread()
	e := faultEngine(t, d, g, cudacopy.MethodMemcpy)
	contents := randomContents(rand.New(rand.NewPCG(6, 6)), 2, e.slot)
	storeContents(t, e, g, seqKeys(0, 2), []int{0, 1}, contents)
	d.StickyAt(cuda.OpMemcpyAsync, d.Calls(cuda.OpMemcpyAsync)+1, cuda.ErrorIllegalAddress)
	op, err := e.Load(context.Background(), seqKeys(0, 2), []int{10, 11}, LoadOptions{})
	require.NoError(t, err)
	require.ErrorContains(t, op.Wait(context.Background()), "CUDA_ERROR_ILLEGAL_ADDRESS")
	_, err = e.Load(context.Background(), seqKeys(0, 1), []int{12}, LoadOptions{})
	require.ErrorIs(t, err, ErrDeviceLost)
	require.ErrorContains(t, err, "refuses new work")
	require.ErrorContains(t, e.Close(), "CUDA_ERROR_ILLEGAL_ADDRESS")
}
