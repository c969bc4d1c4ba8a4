package offload

import (
	"bytes"
	"context"
	"sync/atomic"
	"testing"
	"testing/fstest"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/kvoffload/kvoffload/transfer"
)

// newHookedEngine is newTestEngine with test hooks.
func newHookedEngine(t *testing.T, cfg Config, h engineHooks) *Engine {
	t.Helper()
	cfg.Backend = BackendHost
	cfg.SkipMemoryCheck = true
	e, err := newEngine(cfg, h)
	require.NoError(t, err)
	return e
}

// drained waits until no trimmed region is left to free.
func drained(e *Engine) bool {
	e.reap()
	e.memory.mu.Lock()
	defer e.memory.mu.Unlock()
	return len(e.memory.draining) == 0
}

// TestTrimUnderLoad trims region after region while workers store and load
// with random copy delays and a lease is held across the trims. With the
// gating harness on (released regions poisoned, every copy's host range
// checked live at submission and completion), no copy ever touches a freed
// region, every load is byte-exact, staging buffers keep their address and
// bytes, and the memory counters add up.
func TestTrimUnderLoad(t *testing.T) {
	defer goleak.VerifyNone(t)
	sim, err := cudadev.NewSim(cudadev.SimConfig{Seed: 3, MaxDelay: 200 * time.Microsecond})
	require.NoError(t, err)
	defer func() { require.NoError(t, sim.Close()) }()
	tracker := transfer.NewTracker(func(addr, n uint64) { _ = sim.Fill(addr, n, transfer.PoisonByte) })
	slot := int64(8 << 10)
	e := newHookedEngine(t, Config{PoolBytes: 40 * slot, FirstRegionBytes: 8 * slot, RegionBytes: 8 * slot,
		Layout: simLayout(t, sim, 48), Policy: PolicyLRU, MaxInFlightBytes: 4 * slot},
		engineHooks{tracker: tracker, sim: sim})
	defer func() { require.NoError(t, e.Close()) }()
	require.NoError(t, e.WaitGrown(context.Background()))
	st := e.Stats()
	require.Equal(t, 5, st.Pool.Regions)
	require.Equal(t, 40*slot, st.Pool.OwnedBytes)

	stg, err := e.Staging("graph-out", 1000)
	require.NoError(t, err)
	pattern := bytes.Repeat([]byte{0x3C}, 1000)
	copy(stg.Bytes(), pattern)
	addr := stg.Addr()

	// A lease on a block in the newest region, held across the trims.
	var ta tally
	var lres LookupResult
	for i := 1000; ; i++ {
		require.Less(t, i, 1100, "no store landed in the newest region")
		keys := []Key{testKey(i)}
		writeBlock(t, e, 47, keyContent(keys[0], slot))
		op, err := e.Store(context.Background(), keys, []int{47}, StoreOptions{})
		require.NoError(t, err)
		require.NoError(t, op.Wait(context.Background()))
		ta.add(op, mustOutcomes(op.Outcomes()))
		require.NoError(t, op.Release())
		lres, err = e.Lookup(keys, LookupOptions{Lease: true})
		require.NoError(t, err)
		require.Equal(t, 1, lres.Hits)
		if lres.Lease.slots[0].Region == e.memory.regions[len(e.memory.regions)-1].id {
			break
		}
		require.NoError(t, lres.Lease.Release())
	}
	leasedRegion := lres.Lease.slots[0].Region

	var count atomic.Int64
	stop := make(chan struct{})
	wg := startWorkers(t, e, 4, 64, 2, &ta, &count, stop)
	var freed, pending int64
	for trim := 1; trim <= 3; trim++ {
		for count.Load() < int64(150*trim) && !t.Failed() {
			time.Sleep(time.Millisecond)
		}
		res, err := e.Trim(context.Background(), 8*slot)
		require.NoError(t, err)
		require.Equal(t, 1, res.Regions)
		require.Equal(t, 8*slot, res.FreedBytes+res.PendingBytes)
		freed += res.FreedBytes
		pending += res.PendingBytes
		s, err := e.Staging("graph-out", 1000)
		require.NoError(t, err)
		require.Equal(t, addr, s.Addr(), "staging addresses never move")
		require.Equal(t, pattern, s.Bytes(), "Trim never touches staging memory")
	}
	close(stop)
	wg.Wait()
	require.Positive(t, pending, "the region holding the lease is pending, and Trim did not wait for it")
	e.memory.mu.Lock()
	_, leasedStillMapped := e.memory.draining[leasedRegion]
	e.memory.mu.Unlock()
	require.True(t, leasedStillMapped)
	require.NoError(t, lres.Lease.Release())
	require.Eventually(t, func() bool { return drained(e) }, 10*time.Second, time.Millisecond)

	require.Empty(t, tracker.Violations())
	st = e.Stats()
	checkTally(t, st, &ta)
	require.Equal(t, 40*slot-3*8*slot, st.Pool.OwnedBytes)
	require.Equal(t, 2, st.Pool.Regions)
	require.Equal(t, 3*8*slot, st.Pool.TrimmedBytes)
	require.Equal(t, 3*8*slot, freed+pending)
	require.Equal(t, st.Pool.OwnedBytes, st.Pool.SlotsTotal*slot)
	require.Equal(t, int64(3), st.Pool.Trims)
	require.Equal(t, int64(1+5), st.Pool.PinCalls, "the staging region and five pool regions, pinned once each")
	require.Equal(t, int64(3), st.Pool.UnpinCalls)
	require.Positive(t, ta.loaded)
}

// TestTrimWaitsOnlyForCopies checks that a Trim with a copy in flight on
// its region waits for the copy (then frees the region), and that one
// whose ctx ends first reports the region pending and it is freed later.
func TestTrimWaitsOnlyForCopies(t *testing.T) {
	defer goleak.VerifyNone(t)
	sim, err := cudadev.NewSim(cudadev.SimConfig{})
	require.NoError(t, err)
	defer func() { require.NoError(t, sim.Close()) }()
	slot := int64(8 << 10)
	e := newEngineOn(t, Config{PoolBytes: 8 * slot, Layout: simLayout(t, sim, 8), Policy: PolicyLRU}, sim)
	defer func() { require.NoError(t, e.Close()) }()

	// The store waits (StoreOptions.After) on an event recorded on a caller
	// stream held at a gate, so it stays in flight.
	ev, cs, gate := gatedEvent(t, sim)
	defer gate()
	keys := []Key{testKey(1)}
	writeBlock(t, e, 0, keyContent(keys[0], slot))
	op, err := e.Store(context.Background(), keys, []int{0}, StoreOptions{After: uintptr(ev), AfterStream: uintptr(cs)})
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	res, err := e.Trim(ctx, 1)
	require.NoError(t, err)
	require.Equal(t, TrimResult{RequestedBytes: 1, PendingBytes: 8 * slot, Regions: 1, EvictedBlocks: 1}, res)
	select {
	case <-op.Done():
		t.Fatal("store finished before its stream was opened")
	default:
	}
	gate()
	require.NoError(t, op.Wait(context.Background()))
	require.Equal(t, []Outcome{OutcomeStored}, mustOutcomes(op.Outcomes()))
	require.NoError(t, op.Release())
	require.Eventually(t, func() bool { return drained(e) }, 10*time.Second, time.Millisecond)
	st := e.Stats()
	require.Equal(t, int64(0), st.Pool.OwnedBytes)
	require.Equal(t, 8*slot, st.Pool.TrimmedBytes)

	// With the pool gone, stores are refused as full, never wait.
	op, err = e.Store(context.Background(), []Key{testKey(2)}, []int{1}, StoreOptions{})
	require.NoError(t, err)
	require.Equal(t, []Outcome{OutcomeRefusedFull}, mustOutcomes(op.Outcomes()))
	require.NoError(t, op.Release())
}

// TestPauseResumeGrowth pauses background growth while a region is being
// pinned: that region joins, the next does not until ResumeGrowth.
func TestPauseResumeGrowth(t *testing.T) {
	defer goleak.VerifyNone(t)
	slot := int64(8 << 10)
	atRegion2 := make(chan struct{})
	proceed := make(chan struct{})
	e := newHookedEngine(t, Config{PoolBytes: 32 * slot, FirstRegionBytes: 8 * slot, RegionBytes: 8 * slot,
		Layout: smallLayout(8)}, engineHooks{beforeGrow: func(i int) {
		if i == 1 {
			close(atRegion2)
			<-proceed
		}
	}})
	defer func() { require.NoError(t, e.Close()) }()
	st := e.Stats()
	require.Equal(t, 1, st.Pool.Regions, "New returns with the first region")
	require.Positive(t, st.Pool.FirstSlot)
	require.Zero(t, st.Pool.FullPool)
	require.Equal(t, 4, st.Pool.RegionsTotal)
	<-atRegion2
	e.PauseGrowth()
	e.PauseGrowth()
	close(proceed)
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		for e.Stats().Pool.Regions < 2 {
			time.Sleep(time.Millisecond)
		}
		cancel()
	}()
	require.ErrorIs(t, e.WaitGrown(ctx), context.Canceled)
	st = e.Stats()
	require.True(t, st.Pool.GrowthPaused)
	require.Equal(t, 2, st.Pool.Regions, "the region in progress joins, the next waits")
	require.Zero(t, st.Pool.FullPool)
	e.ResumeGrowth()
	e.ResumeGrowth()
	require.NoError(t, e.WaitGrown(context.Background()))
	st = e.Stats()
	require.False(t, st.Pool.GrowthPaused)
	require.Equal(t, 4, st.Pool.Regions)
	require.Equal(t, 32*slot, st.Pool.OwnedBytes)
	require.Equal(t, int64(32), st.Pool.SlotsTotal)
	require.GreaterOrEqual(t, st.Pool.FullPool, st.Pool.FirstSlot)
}

// TestCloseStopsPausedGrowth: Close while growth is paused ends it, and
// WaitGrown reports ErrClosed.
func TestCloseStopsPausedGrowth(t *testing.T) {
	defer goleak.VerifyNone(t)
	slot := int64(8 << 10)
	paused := make(chan struct{})
	e := newHookedEngine(t, Config{PoolBytes: 32 * slot, FirstRegionBytes: 8 * slot, RegionBytes: 8 * slot,
		Layout: smallLayout(8)}, engineHooks{beforeGrow: func(i int) {
		if i == 1 {
			<-paused
		}
	}})
	e.PauseGrowth()
	close(paused)
	require.NoError(t, e.Close())
	require.Less(t, e.Stats().Pool.Regions, 4)
	require.ErrorIs(t, e.WaitGrown(context.Background()), ErrClosed)
}

// TestMaxCachedBytes: with a bound below the pool, growth stops at the
// bound: nothing beyond it is ever pinned (no pin-then-trim), the last
// region shrunk to fit, and GrowTo cannot ask past it.
func TestMaxCachedBytes(t *testing.T) {
	defer goleak.VerifyNone(t)
	slot := int64(8 << 10)
	e := newTestEngine(t, Config{PoolBytes: 32 * slot, FirstRegionBytes: 8 * slot, RegionBytes: 8 * slot,
		MaxCachedBytes: 20 * slot, Layout: smallLayout(8)})
	defer func() { require.NoError(t, e.Close()) }()
	require.NoError(t, e.WaitGrown(context.Background()))
	st := e.Stats()
	require.Equal(t, 20*slot, st.Pool.OwnedBytes, "grown to the bound exactly")
	require.Zero(t, st.Pool.Trims, "nothing pinned beyond the bound, so nothing trimmed")
	require.Zero(t, st.Pool.TrimmedBytes)
	require.Equal(t, int64(4), st.Pool.PinCalls, "the staging region, then pool regions of 8, 8 and 4 slots")
	require.Equal(t, 3, st.Pool.RegionsTotal)
	require.Equal(t, 20*slot, st.Pool.GrowthTargetBytes)
	require.Equal(t, st.Pool.OwnedBytes, st.Pool.SlotsTotal*slot)
	require.NoError(t, e.GrowTo(32*slot))
	require.NoError(t, e.WaitGrown(context.Background()))
	require.Equal(t, 20*slot, e.Stats().Pool.OwnedBytes, "GrowTo is capped at MaxCachedBytes")
}

// TestTrimDuringGrowthStaysTrimmed: a Trim while the pool still grows is
// not undone by growth: growth stops at what was left (the region being
// grown at the time included), and GrowTo brings the pool back.
func TestTrimDuringGrowthStaysTrimmed(t *testing.T) {
	defer goleak.VerifyNone(t)
	slot := int64(8 << 10)
	reached := make(chan struct{})
	release := make(chan struct{})
	hooks := engineHooks{sys: &system{fsys: fstest.MapFS{}}, beforeGrow: func(i int) {
		if i == 2 {
			close(reached)
			<-release
		}
	}}
	e, err := newEngine(Config{PoolBytes: 64 * slot, FirstRegionBytes: 8 * slot, RegionBytes: 8 * slot,
		Layout: smallLayout(8), Backend: BackendHost, SkipMemoryCheck: true}, hooks)
	require.NoError(t, err)
	defer func() { require.NoError(t, e.Close()) }()
	<-reached // regions 0 and 1 joined (or are joining); region 2 is about to be pinned
	res, err := e.Trim(context.Background(), 8*slot)
	require.NoError(t, err)
	require.Equal(t, 1, res.Regions)
	close(release)
	require.NoError(t, e.WaitGrown(context.Background()))
	st := e.Stats()
	require.Less(t, st.Pool.OwnedBytes, 64*slot-8*slot, "growth stopped after the trim instead of pinning the rest")
	// Regions 0-2, and regions 3 (handed over) and 4 (being prefaulted)
	// which the prefetch stage may have mapped ahead, less the trimmed one.
	require.LessOrEqual(t, st.Pool.OwnedBytes, 5*8*slot-8*slot, "at most the regions mapped before the trim, less the trimmed one")
	require.Equal(t, st.Pool.OwnedBytes, st.Pool.GrowthTargetBytes)

	require.NoError(t, e.GrowTo(64*slot))
	require.NoError(t, e.WaitGrown(context.Background()))
	st = e.Stats()
	require.Equal(t, 64*slot, st.Pool.OwnedBytes, "GrowTo grows the pool back to its size")
	require.Equal(t, st.Pool.OwnedBytes, st.Pool.SlotsTotal*slot)
	require.NotZero(t, st.Pool.FullPool)
	require.ErrorIs(t, e.GrowTo(-1), ErrInvalidArgument)
}

// TestLeaseSurvivesTrimAndDelete: a Lookup lease keeps its blocks'
// bytes through a Trim of their region and a Delete of their keys, so a
// Load with the lease still loads them; the region is freed after.
func TestLeaseSurvivesTrimAndDelete(t *testing.T) {
	defer goleak.VerifyNone(t)
	sim, err := cudadev.NewSim(cudadev.SimConfig{})
	require.NoError(t, err)
	defer func() { require.NoError(t, sim.Close()) }()
	slot := int64(8 << 10)
	e := newEngineOn(t, Config{PoolBytes: 8 * slot, Layout: simLayout(t, sim, 8), Policy: PolicyLRU}, sim)
	defer func() { require.NoError(t, e.Close()) }()
	ctx := context.Background()
	keys := []Key{testKey(1), testKey(2)}
	for i, k := range keys {
		writeBlock(t, e, i, keyContent(k, slot))
	}
	op, err := e.Store(ctx, keys, []int{0, 1}, StoreOptions{})
	require.NoError(t, err)
	require.NoError(t, op.Wait(ctx))
	require.NoError(t, op.Release())
	res, err := e.Lookup(keys, LookupOptions{Lease: true})
	require.NoError(t, err)
	require.Equal(t, 2, res.Hits)

	tr, err := e.Trim(ctx, 1)
	require.NoError(t, err)
	require.Equal(t, 8*slot, tr.PendingBytes, "the leased region waits for its lease")
	n, err := e.Delete(keys)
	require.NoError(t, err)
	require.Zero(t, n, "trimmed keys are already gone from the index")
	look, err := e.Lookup(keys, LookupOptions{})
	require.NoError(t, err)
	require.Zero(t, look.Hits)

	op, err = e.Load(ctx, keys, []int{4, 5}, LoadOptions{Lease: res.Lease})
	require.NoError(t, err)
	require.NoError(t, op.Wait(ctx))
	require.Equal(t, []Outcome{OutcomeLoaded, OutcomeLoaded}, mustOutcomes(op.Outcomes()))
	require.Equal(t, keyContent(keys[0], slot), blockBytes(e, 4))
	require.Equal(t, keyContent(keys[1], slot), blockBytes(e, 5))
	require.NoError(t, op.Release())
	require.Eventually(t, func() bool { return drained(e) }, 10*time.Second, time.Millisecond)
	st := e.Stats()
	require.Equal(t, 8*slot, st.Pool.TrimmedBytes)
	require.Zero(t, st.Pool.OwnedBytes)
}
