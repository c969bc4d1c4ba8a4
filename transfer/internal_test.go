package transfer

// The tests of this file need the package's unexported parts and no
// device; the others (package transfer_test) run the scheduler over
// internal/cudadev's devices, which import this package.

import (
	"math/rand"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func FuzzValidate(f *testing.F) {
	f.Add(uint64(0x1000), uint64(0x2000), uint64(16), uint64(16))
	f.Add(uint64(0x1ff0), uint64(0x2000), uint64(32), uint64(1))
	f.Add(^uint64(0), uint64(0), uint64(2), uint64(8))
	f.Fuzz(func(t *testing.T, dev, host, n, align uint64) {
		align = 1 << (align % 8)
		var hs, ds rangeSet
		require.NoError(t, hs.add(0x2000, 0x1000))
		require.NoError(t, ds.add(0x1000, 0x1000))
		out, err := validate([]Segment{{Dev: dev, Host: host, Len: n}}, align, &hs, &ds, nil)
		if err != nil {
			require.Empty(t, out)
			return
		}
		require.NotZero(t, n)
		require.True(t, dev >= 0x1000 && dev+n <= 0x2000 && dev+n > dev, "dev %#x+%d accepted", dev, n)
		require.True(t, host >= 0x2000 && host+n <= 0x3000 && host+n > host, "host %#x+%d accepted", host, n)
		require.Zero(t, (dev|host|n)%align)
	})
}

func TestCoalesce(t *testing.T) {
	p := func(d, h, n, hid, did uint64) placed {
		return placed{Segment: Segment{Dev: d, Host: h, Len: n}, hostID: hid, devID: did}
	}
	tests := []struct {
		name string
		in   []placed
		want []Segment
	}{
		{"both contiguous", []placed{p(0, 100, 10, 1, 1), p(10, 110, 5, 1, 1)}, []Segment{{Dev: 0, Host: 100, Len: 15}}},
		{"host gap", []placed{p(0, 100, 10, 1, 1), p(10, 111, 5, 1, 1)}, []Segment{{Dev: 0, Host: 100, Len: 10}, {Dev: 10, Host: 111, Len: 5}}},
		{"device gap", []placed{p(0, 100, 10, 1, 1), p(11, 110, 5, 1, 1)}, []Segment{{Dev: 0, Host: 100, Len: 10}, {Dev: 11, Host: 110, Len: 5}}},
		{"across two host ranges", []placed{p(0, 100, 10, 1, 1), p(10, 110, 5, 2, 1)}, []Segment{{Dev: 0, Host: 100, Len: 10}, {Dev: 10, Host: 110, Len: 5}}},
		{"three in a row", []placed{p(0, 0, 1, 1, 1), p(1, 1, 1, 1, 1), p(2, 2, 1, 1, 1)}, []Segment{{Dev: 0, Host: 0, Len: 3}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var last placed
			require.Equal(t, tc.want, coalesce(nil, &last, tc.in))
		})
	}
}

// TestRangeSetLookupNear: whatever the hint, lookupNear finds what a plain
// binary search finds (the range holding the whole span, or none), and the
// index it returns is that range's.
func TestRangeSetLookupNear(t *testing.T) {
	rng := rand.New(rand.NewSource(7))
	for round := range 50 {
		var rs rangeSet
		base := uint64(0x10000)
		for range 1 + rng.Intn(40) {
			base += uint64(rng.Intn(3)) * 0x100 // adjacent ranges too
			size := uint64(1+rng.Intn(16)) * 0x100
			require.NoError(t, rs.add(base, size))
			base += size
		}
		for range 2000 {
			addr := 0x10000 - 0x200 + uint64(rng.Intn(int(base-0x10000+0x400)))
			n := uint64(1 + rng.Intn(0x800))
			hint := rng.Intn(len(rs.ranges)+2) - 1
			// The reference: the last range starting at or below addr.
			var want memRange
			wantOK := false
			for _, r := range rs.ranges {
				if r.base <= addr {
					want, wantOK = r, r.holds(addr, n)
				}
			}
			got, at, ok := rs.lookupNear(addr, n, hint)
			require.Equal(t, wantOK, ok, "round %d addr %#x+%d hint %d", round, addr, n, hint)
			if ok {
				require.Equal(t, want, got)
				require.Equal(t, want, rs.ranges[at])
			}
		}
	}
}

// TestCoalesceStrided: 2-D segments are never joined to a neighbour.
func TestCoalesceStrided(t *testing.T) {
	a := Segment{Dev: 0, Host: 0, Len: 128, Rows: 2, RowLen: 64, DevPitch: 64, HostPitch: 64}
	b := Segment{Dev: 128, Host: 128, Len: 64}
	c := Segment{Dev: 192, Host: 192, Len: 128, Rows: 2, RowLen: 64, DevPitch: 64, HostPitch: 64}
	in := []placed{{Segment: a, hostID: 1, devID: 1}, {Segment: b, hostID: 1, devID: 1}, {Segment: c, hostID: 1, devID: 1}}
	var last placed
	require.Equal(t, []Segment{a, b, c}, coalesce(nil, &last, in))
}

func TestTrackerDeclarations(t *testing.T) {
	if !InvariantsEnabled() {
		t.Skip("Tracker is a no-op without invariants")
	}
	tr := NewTracker(nil)
	require.NoError(t, tr.Live(0x1000, 0x100))
	require.ErrorIs(t, tr.Live(0x10f0, 0x20), ErrInvalidRequest, "overlap")
	require.ErrorIs(t, tr.Live(0x2000, 0), ErrInvalidRequest, "empty")
	require.ErrorIs(t, tr.Released(0x1000, 0x80), ErrInvalidRequest, "not as declared")
	require.NoError(t, tr.Released(0x1000, 0x100))
	require.ErrorIs(t, tr.Released(0x1000, 0x100), ErrInvalidRequest, "twice")
	// A range released and declared live again between a copy's submission
	// and completion is caught by its generation.
	require.NoError(t, tr.Live(0x1000, 0x100))
	segs := []placed{{Segment: Segment{Host: 0x1000, Len: 0x100}}}
	g := tr.gens("at submission", Store, segs, nil)
	require.NoError(t, tr.Released(0x1000, 0x100))
	require.NoError(t, tr.Live(0x1000, 0x100))
	tr.gens("at completion", Store, segs, g)
	require.Len(t, tr.Violations(), 1)
	require.ErrorIs(t, tr.Violations()[0], ErrInvariant)
}

// TestSpinFor: the poll returns what arrives while a call is announced,
// and gives up at once when none is (pending ≤ 0), or as soon as the
// announced call ends, long before its deadline.
func TestSpinFor(t *testing.T) {
	var pending atomic.Int32
	ch := make(chan int, 1)
	t0 := time.Now()
	_, ok := spinFor(ch, 10*time.Second, &pending)
	require.False(t, ok)
	require.Less(t, time.Since(t0), time.Second, "polled with no call announced")

	pending.Store(1)
	go func() { time.Sleep(5 * time.Millisecond); ch <- 7 }()
	v, ok := spinFor(ch, 10*time.Second, &pending)
	require.True(t, ok)
	require.Equal(t, 7, v)

	go func() { time.Sleep(5 * time.Millisecond); pending.Store(0) }()
	t0 = time.Now()
	_, ok = spinFor(ch, 10*time.Second, &pending)
	require.False(t, ok)
	require.Less(t, time.Since(t0), 5*time.Second, "kept polling after the announced call ended")

	pending.Store(1)
	t0 = time.Now()
	_, ok = spinFor(ch, 20*time.Millisecond, &pending)
	require.False(t, ok)
	require.GreaterOrEqual(t, time.Since(t0), 20*time.Millisecond)
}

// TestPrewakeDefault: the poll is on by default only where GOMAXPROCS is 8
// or more, and off where PrewakeSpin is negative.
func TestPrewakeDefault(t *testing.T) {
	c := Config{}
	require.NoError(t, c.setDefaults())
	if runtime.GOMAXPROCS(0) >= 8 {
		require.Equal(t, DefaultPrewakeSpin, c.PrewakeSpin)
	} else {
		require.Zero(t, c.PrewakeSpin)
	}
	c = Config{PrewakeSpin: -1}
	require.NoError(t, c.setDefaults())
	require.Negative(t, c.PrewakeSpin)
}
