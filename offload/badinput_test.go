package offload

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/transfer"
)

// state is what a refused call must leave unchanged.
type state struct {
	outcomes [numOutcomes]int64
	storeOps int64
	loadOps  int64
	inUse    int64
	free     int64
	ready    int64
	leased   int64
}

func stateOf(e *Engine) state {
	st := e.Stats()
	return state{outcomes: st.Outcomes, storeOps: st.Copies.Store.Ops, loadOps: st.Copies.Load.Ops, inUse: st.Pool.InUseBytes,
		free: st.Pool.SlotsFree, ready: st.Pool.BlocksReady, leased: st.Pool.BlocksLeased}
}

func TestBadInput(t *testing.T) {
	defer goleak.VerifyNone(t)
	e := newTestEngine(t, Config{PoolBytes: 64 << 10, Layout: smallLayout(8), Policy: PolicyLRU})
	defer func() { require.NoError(t, e.Close()) }()
	ctx := context.Background()
	k := []Key{testKey(1), testKey(2), testKey(3)}
	op, err := e.Store(ctx, k[:1], []int{0}, StoreOptions{})
	require.NoError(t, err)
	require.NoError(t, op.Wait(ctx))
	require.NoError(t, op.Release())
	before := stateOf(e)

	cases := []struct {
		name string
		call func() error
		want error
		msg  string
	}{
		{"store lengths differ", func() error { _, err := e.Store(ctx, k[:2], []int{1}, StoreOptions{}); return err },
			ErrInvalidArgument, "2 keys but 1 block ids"},
		{"load lengths differ", func() error { _, err := e.Load(ctx, k[:1], []int{1, 2}, LoadOptions{}); return err },
			ErrInvalidArgument, "1 keys but 2 block ids"},
		{"store block id past the layout", func() error { _, err := e.Store(ctx, k[1:3], []int{1, 8}, StoreOptions{}); return err },
			ErrInvalidArgument, "block id 8 (index 1) outside the layout's 8 blocks"},
		{"load negative block id", func() error { _, err := e.Load(ctx, k[:1], []int{-1}, LoadOptions{}); return err },
			ErrInvalidArgument, "block id -1"},
		{"store duplicate block id", func() error { _, err := e.Store(ctx, k[1:3], []int{2, 2}, StoreOptions{}); return err },
			ErrInvalidArgument, "block id 2 appears twice"},
		{"store duplicate key", func() error {
			_, err := e.Store(ctx, []Key{k[1], k[2], k[1]}, []int{1, 2, 3}, StoreOptions{})
			return err
		}, ErrInvalidArgument, "index 2"},
		{"AfterStream without After", func() error {
			_, err := e.Store(ctx, k[1:2], []int{1}, StoreOptions{AfterStream: 5})
			return err
		}, ErrInvalidArgument, "without After"},
		{"staging of zero bytes", func() error { _, err := e.Staging("x", 0); return err }, ErrInvalidArgument, "must be at least 1"},
		{"staging larger than the region", func() error { _, err := e.Staging("big", 1<<40); return err },
			ErrInsufficientMemory, "raise Config.StagingBytes"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := c.call()
			require.ErrorIs(t, err, c.want)
			require.ErrorContains(t, err, c.msg)
			require.Equal(t, before, stateOf(e), "a refused call changes nothing")
		})
	}

	t.Run("released op", func(t *testing.T) {
		op, err := e.Load(ctx, k[:1], []int{4}, LoadOptions{PerLayer: true})
		require.NoError(t, err)
		require.NoError(t, op.Wait(ctx))
		require.Equal(t, []Outcome{OutcomeLoaded}, mustOutcomes(op.Outcomes()))
		_, err = op.LayerEvent(2)
		require.ErrorIs(t, err, ErrInvalidArgument, "layer outside the layout")
		require.NoError(t, op.Release())
		require.ErrorIs(t, op.Release(), ErrReleased)
		require.ErrorIs(t, op.Wait(ctx), ErrReleased)
		require.ErrorIs(t, op.Err(), ErrReleased)
		_, err = op.Outcomes()
		require.ErrorIs(t, err, ErrReleased)
		_, err = op.Event()
		require.ErrorIs(t, err, ErrReleased)
		_, err = op.LayerEvent(0)
		require.ErrorIs(t, err, ErrReleased)
		require.ErrorIs(t, op.StreamWait(0), ErrReleased)
		<-op.Done()
		require.Zero(t, op.count(OutcomeLoaded))
	})

	t.Run("lease not a prefix of the keys", func(t *testing.T) {
		res, err := e.Lookup(k[:1], LookupOptions{Lease: true})
		require.NoError(t, err)
		mid := stateOf(e)
		_, err = e.Load(ctx, k[1:2], []int{4}, LoadOptions{Lease: res.Lease})
		require.ErrorIs(t, err, ErrInvalidArgument)
		require.ErrorContains(t, err, "must be a prefix")
		require.Equal(t, mid, stateOf(e))
		op, err := e.Load(ctx, k[:1], []int{4}, LoadOptions{Lease: res.Lease})
		require.NoError(t, err, "after a refused Load the lease is still the caller's")
		require.NoError(t, op.Wait(ctx))
		require.Equal(t, []Outcome{OutcomeLoaded}, mustOutcomes(op.Outcomes()))
		require.NoError(t, op.Release())
		require.ErrorIs(t, res.Lease.Release(), ErrReleased)
	})

	t.Run("released lease", func(t *testing.T) {
		res, err := e.Lookup(k[:1], LookupOptions{Lease: true})
		require.NoError(t, err)
		require.Equal(t, 1, res.Hits)
		require.Equal(t, k[:1], res.Lease.leasedKeys())
		require.NoError(t, res.Lease.Release())
		require.ErrorIs(t, res.Lease.Release(), ErrReleased)
		mid := stateOf(e)
		_, err = e.Load(ctx, k[:1], []int{4}, LoadOptions{Lease: res.Lease})
		require.ErrorIs(t, err, ErrReleased)
		require.Equal(t, mid, stateOf(e))
	})
}

func TestNewBadConfig(t *testing.T) {
	defer goleak.VerifyNone(t)
	noDriver := func() (cuda.Driver, error) { return nil, cuda.ErrNoDriver }
	cases := []struct {
		name string
		cfg  Config
		want error
		msg  string
	}{
		{"pool too small", Config{PoolBytes: 1024, Layout: smallLayout(8)}, ErrPoolTooSmall, "cannot hold one block of 8192 bytes"},
		{"unknown backend", Config{PoolBytes: 1 << 20, Layout: smallLayout(8), Backend: "tpu"}, ErrInvalidConfig, `Backend "tpu"`},
		{"cuda without a driver", Config{PoolBytes: 1 << 20, Layout: smallLayout(8), Backend: BackendCUDA}, ErrInvalidConfig, "device tensors"},
		{"no pool", Config{Layout: smallLayout(8)}, ErrInvalidConfig, "PoolBytes = 0"},
		{"a host device not hostsim's", Config{PoolBytes: 1 << 20, Layout: smallLayout(8), Backend: BackendHost, HostDevice: otherDevice{}},
			ErrInvalidConfig, "HostDevice is a offload.otherDevice, not a hostsim GPU's device"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			c.cfg.SkipMemoryCheck = true
			e, err := newEngine(c.cfg, engineHooks{loadDriver: loader(noDriver)})
			require.Nil(t, e)
			require.ErrorIs(t, err, c.want)
			require.ErrorContains(t, err, c.msg)
		})
	}
}

func TestCallsAfterClose(t *testing.T) {
	defer goleak.VerifyNone(t)
	e := newTestEngine(t, Config{PoolBytes: 64 << 10, Layout: smallLayout(8)})
	ctx := context.Background()
	k := []Key{testKey(1)}
	op, err := e.Store(ctx, k, []int{0}, StoreOptions{})
	require.NoError(t, err)
	res, err := e.Lookup(nil, LookupOptions{})
	require.NoError(t, err)
	require.Zero(t, res.Hits)
	require.NoError(t, e.Close())
	<-op.Done()
	require.Len(t, mustOutcomes(op.Outcomes()), 1, "ops stay readable after Close")
	require.NoError(t, op.Release())

	calls := map[string]func() error{
		"Store":  func() error { _, err := e.Store(ctx, k, []int{0}, StoreOptions{}); return err },
		"Load":   func() error { _, err := e.Load(ctx, k, []int{0}, LoadOptions{}); return err },
		"Lookup": func() error { _, err := e.Lookup(k, LookupOptions{}); return err },
		"Delete": func() error { _, err := e.Delete(k); return err },
		"Clear":  func() error { _, err := e.Clear(""); return err },
		"Trim":   func() error { _, err := e.Trim(ctx, 1); return err },
		"Staging": func() error {
			_, err := e.Staging("s", 1)
			return err
		},
		"Close": e.Close,
	}
	for name, call := range calls {
		err := call()
		require.ErrorIs(t, err, ErrClosed, name)
		require.ErrorContains(t, err, name, "the error names the call")
	}
	st := e.Stats()
	require.Zero(t, st.Pool.OwnedBytes)
	require.Zero(t, st.Pool.Regions)
}

// withComparisonSwitches has New read the comparison switches, as a
// build with -tags kvocompare does, until t ends.
func withComparisonSwitches(t *testing.T) {
	old := comparisonSwitches
	comparisonSwitches = true
	t.Cleanup(func() { comparisonSwitches = old })
}

// The release engine ignores the comparison switches: a value that would
// be refused is not read.
func TestComparisonSwitchesOff(t *testing.T) {
	if comparisonBuild {
		t.Skip("a kvocompare build reads the switches")
	}
	for _, name := range []string{buildersEnv, partGrowthEnv, wholeFirstLayerEnv, noPitchedStagingEnv, gatherChunkEnv} {
		t.Setenv(name, "x")
	}
	e, err := newEngine(Config{PoolBytes: 1 << 20, Layout: smallLayout(8), Backend: BackendHost, SkipMemoryCheck: true}, engineHooks{})
	require.NoError(t, err)
	require.Equal(t, defaultPartGrowth, e.hooks.partGrowth)
	require.False(t, e.hooks.wholeFirstLayer)
	require.NoError(t, e.Close())
}

// A bad KVOFFLOAD_COPY_BUILDERS is an error from New naming it and the limit.
func TestBuildersEnv(t *testing.T) {
	withComparisonSwitches(t)
	for _, v := range []string{"0", "x", "17", "-1"} {
		t.Setenv(buildersEnv, v)
		_, err := newEngine(Config{PoolBytes: 1 << 20, Layout: smallLayout(8), Backend: BackendHost, SkipMemoryCheck: true}, engineHooks{})
		require.ErrorIs(t, err, ErrInvalidConfig, v)
		require.ErrorContains(t, err, buildersEnv+`="`+v+`": want 1 to 16`, v)
	}
	t.Setenv(buildersEnv, "3")
	e, err := newEngine(Config{PoolBytes: 1 << 20, Layout: smallLayout(8), Backend: BackendHost, SkipMemoryCheck: true}, engineHooks{})
	require.NoError(t, err)
	require.NoError(t, e.Close())
}

// The other integer comparison settings (envInt): a bad value is an
// error from New naming it and its range; a good one is taken.
func TestIntEnvs(t *testing.T) {
	withComparisonSwitches(t)
	cfg := Config{PoolBytes: 1 << 20, Layout: smallLayout(8), Backend: BackendHost, SkipMemoryCheck: true}
	for _, tc := range []struct {
		name, want string
		bad        []string
		good       string
	}{
		{partGrowthEnv, "want 0 to 8 growing parts", []string{"9", "-1", "x"}, "3"},
		{traceCallsEnv, "want 0 to 1048576 calls", []string{"1048577", "-1", "all"}, "2"},
	} {
		for _, v := range tc.bad {
			t.Setenv(tc.name, v)
			_, err := newEngine(cfg, engineHooks{})
			require.ErrorIs(t, err, ErrInvalidConfig, "%s=%s", tc.name, v)
			require.ErrorContains(t, err, tc.name+`="`+v+`": `+tc.want)
		}
		t.Setenv(tc.name, tc.good)
		e, err := newEngine(cfg, engineHooks{})
		require.NoError(t, err, "%s=%s", tc.name, tc.good)
		require.NoError(t, e.Close())
		t.Setenv(tc.name, "")
	}
}

// KVOFFLOAD_WHOLE_FIRST_LAYER takes 0 or 1; another value is an error from
// New naming it; 1 keeps a per-layer load's first layer one part.
func TestWholeFirstLayerEnv(t *testing.T) {
	withComparisonSwitches(t)
	cfg := Config{PoolBytes: 1 << 20, Layout: smallLayout(8), Backend: BackendHost, SkipMemoryCheck: true}
	for _, v := range []string{"2", "yes", "-1"} {
		t.Setenv(wholeFirstLayerEnv, v)
		_, err := newEngine(cfg, engineHooks{})
		require.ErrorIs(t, err, ErrInvalidConfig, v)
		require.ErrorContains(t, err, wholeFirstLayerEnv+`="`+v+`": want 0 or 1`, v)
	}
	for _, v := range []string{"0", "1"} {
		t.Setenv(wholeFirstLayerEnv, v)
		e, err := newEngine(cfg, engineHooks{})
		require.NoError(t, err)
		require.Equal(t, v == "1", e.hooks.wholeFirstLayer)
		require.NoError(t, e.Close())
	}
}

// KVOFFLOAD_TRACE_CALLS=2 traces the first two Store and Load calls, each
// as one line with the points the call reached, a failed call with its
// error; later calls are not traced.
func TestTraceCallsEnv(t *testing.T) {
	t.Setenv(traceCallsEnv, "2")
	e, err := New(Config{PoolBytes: 1 << 20, Layout: smallLayout(8), Backend: BackendHost, SkipMemoryCheck: true})
	require.NoError(t, err)
	defer func() { require.NoError(t, e.Close()) }()
	var buf bytes.Buffer
	require.NotNil(t, e.calls)
	e.calls.w = &buf
	ctx := context.Background()
	keys := []Key{testKey(1), testKey(2)}
	op, err := e.Store(ctx, keys, []int{0, 1}, StoreOptions{})
	require.NoError(t, err)
	require.NoError(t, op.Wait(ctx))
	_, err = e.Load(ctx, keys, []int{2, 2}, LoadOptions{})
	require.ErrorIs(t, err, ErrInvalidArgument)
	op, err = e.Load(ctx, keys, []int{2, 3}, LoadOptions{})
	require.NoError(t, err)
	require.NoError(t, op.Wait(ctx))
	lines := strings.Split(strings.TrimSuffix(buf.String(), "\n"), "\n")
	require.Len(t, lines, 2, buf.String())
	require.Regexp(t, `^kvoffload trace: Store of 2 blocks entered at [0-9]+ ns \(CLOCK_MONOTONIC\), returned after [0-9.]+ ms: checked [0-9.]+ .* \(ms from the call's entry\)$`, lines[0])
	require.Regexp(t, `^kvoffload trace: Load of 2 blocks entered at [0-9]+ ns \(CLOCK_MONOTONIC\), returned after [0-9.]+ ms \(error: .*block id 2.*\):`, lines[1])
	// A tracer with no budget left traces nothing.
	require.False(t, e.calls.begin("Load", 1))
	// The engine's points in order, on a call that got past the checks.
	tr := newCallTracer(&buf, 1)
	e.calls, e.hooks.trace = tr, tr.point
	buf.Reset()
	op, err = e.Load(ctx, keys, []int{4, 5}, LoadOptions{})
	require.NoError(t, err)
	require.NoError(t, op.Wait(ctx))
	require.Regexp(t, `Load of 2 blocks entered at [0-9]+ ns \(CLOCK_MONOTONIC\), returned after [0-9.]+ ms: checked [0-9.]+ load [0-9.]+ begun [0-9.]+ plan [0-9.]+ planned [0-9.]+ held [0-9.]+`, buf.String())
}

// otherDevice is a transfer.Device that is not hostsim's simulated one.
type otherDevice struct{ transfer.Device }
