package cudacopy

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"
)

// drain runs the chunker into tables of capacity cap and returns every
// descriptor with the number of tables used.
func drain(t require.TestingT, ck *chunker, capacity int) ([]desc, int) {
	var all []desc
	tables := 0
	table := make([]desc, capacity)
	for !ck.done() {
		n, err := ck.next(table)
		require.NoError(t, err)
		require.Positive(t, n)
		all = append(all, table[:n]...)
		tables++
	}
	return all, tables
}

// Chunks cover exactly the segments, in order, none longer than the chunk
// size, each starting at a multiple of the chunk size from its segment's
// start (so alignment is preserved), with count() predicting the total.
func TestChunkerCoversSegments(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		chunk := uint64(rapid.IntRange(1, 64).Draw(t, "chunk16")) * 16
		capacity := rapid.IntRange(1, 9).Draw(t, "capacity")
		n := rapid.IntRange(1, 20).Draw(t, "segments")
		segs := make([]Segment, n)
		for i := range segs {
			segs[i] = Segment{
				Src: rapid.Uint64Range(1, 1<<40).Draw(t, "src") * 16,
				Dst: rapid.Uint64Range(1, 1<<40).Draw(t, "dst") * 16,
				Len: rapid.Uint64Range(1, 5*chunk).Draw(t, "len"),
			}
		}
		ck := chunker{kind: jobCopy, copies: segs, chunk: chunk}
		want := ck.count()
		all, tables := drain(t, &ck, capacity)
		require.Len(t, all, want)
		require.Equal(t, (want+capacity-1)/capacity, tables)
		k := 0
		for _, s := range segs {
			var off uint64
			for off < s.Len {
				d := all[k]
				require.Equal(t, s.Src+off, d.Src)
				require.Equal(t, s.Dst+off, d.Dst)
				require.LessOrEqual(t, d.Len, chunk)
				require.Positive(t, d.Len)
				require.Zero(t, off%chunk)
				if s.Len%16 == 0 {
					require.Zero(t, (d.Src|d.Dst|d.Len)%16, "an aligned segment gives aligned chunks")
				}
				off += d.Len
				k++
			}
			require.Equal(t, s.Len, off)
		}
	})
}

func TestChunkerFillSeedsFollowOffsets(t *testing.T) {
	ck := chunker{kind: jobFill, fills: []FillSegment{{Dst: 0x1000, Len: 5000, Seed: 7}, {Dst: 0x9000, Len: 8, Seed: 99}}, chunk: 2048}
	all, _ := drain(t, &ck, 2)
	require.Equal(t, []desc{
		{Dst: 0x1000, Len: 2048, Aux: 7},
		{Dst: 0x1000 + 2048, Len: 2048, Aux: 7 + 256},
		{Dst: 0x1000 + 4096, Len: 904, Aux: 7 + 512},
		{Dst: 0x9000, Len: 8, Aux: 99},
	}, all)
}

func TestChunkerChecksumIsOnePerSpan(t *testing.T) {
	ck := chunker{kind: jobChecksum, spans: []Span{{Addr: 0x100, Len: 1 << 20}, {Addr: 0x900000, Len: 64}}}
	require.Equal(t, 2, ck.count())
	all, _ := drain(t, &ck, 8)
	require.Equal(t, []desc{{Src: 0x100, Len: 1 << 20}, {Src: 0x900000, Len: 64}}, all)
}

func TestChunkerTranslatesHostSide(t *testing.T) {
	var h hostTable
	require.NoError(t, h.add(hostRange{base: 0x10000, size: 0x10000, dev: 0x7000000}))
	segs := []Segment{{Src: 0x2000, Dst: 0x10100, Len: 0x100}}

	d2h := chunker{kind: jobCopy, copies: segs, chunk: 0x80, host: &h, hostDst: true}
	require.NoError(t, d2h.translateAll())
	all, _ := drain(t, &d2h, 4)
	require.Equal(t, []desc{{Src: 0x2000, Dst: 0x7000100, Len: 0x80}, {Src: 0x2080, Dst: 0x7000180, Len: 0x80}}, all)

	// The same segment read as H2D names an unregistered host source.
	h2d := chunker{kind: jobCopy, copies: segs, chunk: 0x80, host: &h, hostSrc: true}
	require.ErrorIs(t, h2d.translateAll(), ErrUnregisteredHost)

	// A fill translates addresses found in the table and leaves others.
	f := chunker{kind: jobFill, fills: []FillSegment{{Dst: 0x10000, Len: 16}, {Dst: 0x50000, Len: 16}}, host: &h}
	all, _ = drain(t, &f, 4)
	require.Equal(t, uint64(0x7000000), all[0].Dst)
	require.Equal(t, uint64(0x50000), all[1].Dst)
}

func TestHostTable(t *testing.T) {
	var h hostTable
	require.NoError(t, h.add(hostRange{base: 0x10000, size: 0x1000, dev: 0x10000}))
	require.NoError(t, h.add(hostRange{base: 0x30000, size: 0x1000, dev: 0x90000}))
	require.NoError(t, h.add(hostRange{base: 0x20000, size: 0x1000, dev: 0x20000}))
	for _, bad := range []hostRange{
		{base: 0x10800, size: 0x1000}, // overlaps the first
		{base: 0xF000, size: 0x1001},  // reaches into the first
		{base: 0, size: 10},
		{base: 0x50000, size: 0},
		{base: ^uint64(0) - 5, size: 10},
	} {
		require.ErrorIs(t, h.add(bad), ErrInvalidOption, "%+v", bad)
	}
	tests := []struct {
		addr, n, want uint64
		ok            bool
	}{
		{0x10000, 0x1000, 0x10000, true},
		{0x30010, 0x10, 0x90010, true},
		{0x30FF0, 0x20, 0, false}, // runs past the end
		{0x31000, 1, 0, false},
		{0xFFFF, 1, 0, false},
	}
	for _, tc := range tests {
		got, ok := h.translate(tc.addr, tc.n)
		require.Equal(t, tc.ok, ok, "%#x+%d", tc.addr, tc.n)
		require.Equal(t, tc.want, got)
	}
	require.NoError(t, h.remove(0x20000))
	require.ErrorIs(t, h.remove(0x20000), ErrInvalidOption)
	_, ok := h.translate(0x20000, 1)
	require.False(t, ok)
}

// BenchmarkChunkerCopy builds the descriptors of 65536 4 KiB D2H segments
// at random slots (256 MiB, one full table) with host translation, as
// Submit does: the CPU cost per descriptor.
func BenchmarkChunkerCopy(b *testing.B) {
	const n, size = 1 << 16, 4 << 10
	host := uint64(0x7f00_0000_0000)
	ht := &hostTable{}
	require.NoError(b, ht.add(hostRange{base: host, size: n * size, dev: 0x10_0000_0000}))
	require.NoError(b, ht.add(hostRange{base: host + 2*n*size, size: n * size, dev: 0x20_0000_0000}))
	segs := ScatteredSegments(D2H, host, 0x30_0000_0000, size, n, rand.New(rand.NewPCG(1, 2)))
	out := make([]desc, n)
	b.ResetTimer()
	for b.Loop() {
		ck := chunker{kind: jobCopy, copies: segs, chunk: DefaultChunkBytes, host: ht, hostDst: true}
		if err := ck.translateAll(); err != nil {
			b.Fatal(err)
		}
		if w, err := ck.next(out); err != nil || w != n {
			b.Fatal(w, err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/desc")
}
