package kvcache

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestMaxSlots: the hint is validated, and a pool growing below, up to and
// beyond it keeps every slot usable (the reserve changes cost, not
// behaviour).
func TestMaxSlots(t *testing.T) {
	for _, tc := range []struct {
		name    string
		max     int
		regions []int // slots per region
		err     bool
	}{
		{name: "negative", max: -1, err: true},
		{name: "too large", max: MaxSlots + 1, err: true},
		{name: "below", max: 100, regions: []int{10, 20}},
		{name: "exactly", max: 30, regions: []int{10, 20}},
		{name: "beyond", max: 8, regions: []int{10, 20, 5}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := New(Config{Layout: tinyLayout(t, 1024), SlotAlign: 256, MaxSlots: tc.max})
			if tc.err {
				require.ErrorIs(t, err, errConfig)
				return
			}
			require.NoError(t, err)
			defer c.Close()
			base, total := uintptr(0x10000), 0
			for i, n := range tc.regions {
				got, err := c.AddRegion(Region{ID: RegionID(i + 1), Base: base, Size: uint64(n) * 256})
				require.NoError(t, err)
				require.Equal(t, n, got)
				base += uintptr(n) * 256
				total += n
			}
			st := c.Stats()
			require.Equal(t, total, st.Slots)
			require.Equal(t, total, st.Free)
		})
	}
}

// BenchmarkAddRegionGrowth adds a 64 GiB pool of 8 KiB slots (1 GiB, then
// 4 GiB regions in 2 GiB registration ranges, as offload plans it) to a
// cache with and without the MaxSlots reserve; no memory is mapped (slot
// carving only needs addresses).
func BenchmarkAddRegionGrowth(b *testing.B) {
	const slot, pool = 8 << 10, 64 << 30
	g := Geometry{Layers: 2, KVHeads: 1, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16}
	l, err := NewLayout(denseSpec(CrossLayer, g, 64, 1<<40))
	require.NoError(b, err)
	require.EqualValues(b, slot, l.SlotSize())
	sizes := []uint64{1 << 30}
	for left := uint64(pool - 1<<30); left > 0; left -= min(left, 4<<30) {
		sizes = append(sizes, min(left, 4<<30))
	}
	for _, hint := range []int{0, pool / slot} {
		b.Run(map[bool]string{true: "reserved", false: "unreserved"}[hint > 0], func(b *testing.B) {
			for b.Loop() {
				c, err := New(Config{Layout: l, MaxSlots: hint})
				require.NoError(b, err)
				base := uintptr(1 << 44)
				for i, s := range sizes {
					var starts []uint64
					for o := uint64(2 << 30); o < s; o += 2 << 30 {
						starts = append(starts, o)
					}
					_, err := c.AddRegion(Region{ID: RegionID(i + 1), Base: base, Size: s, RangeStarts: starts})
					require.NoError(b, err)
					base += uintptr(s)
				}
				c.Close()
			}
			b.ReportMetric(float64(b.Elapsed().Milliseconds())/float64(b.N), "ms/64GiB-pool")
		})
	}
}
