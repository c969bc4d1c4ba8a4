package cudacopy

import (
	"bytes"
	mrand "math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
)

// layerSegs is one layer of a per-layer load (H2D) or store (D2H swapped):
// block b lives in host slot slots[b] (slot bytes each, the layer's K and V
// back to back at layer × 2 × seg) and device block pd[b] of the layer's K
// and V tensors (blocks × seg each, after the earlier layers').
func layerSegs(host, dev uint64, slots, pd []int, layers, layer int, seg uint64) []Segment {
	slot := uint64(2*layers) * seg
	blocks := uint64(len(pd))
	var out []Segment
	for b, s := range slots {
		for kv := range uint64(2) {
			h := uint64(s)*slot + (uint64(2*layer)+kv)*seg
			d := ((uint64(2*layer)+kv)*blocks + uint64(pd[b])) * seg
			out = append(out, Segment{Dst: dev + d, Src: host + h, Len: seg})
		}
	}
	return out
}

func swapped(segs []Segment, host, host2 uint64) []Segment {
	out := make([]Segment, len(segs))
	for i, g := range segs {
		out[i] = Segment{Dst: g.Src - host + host2, Src: g.Dst, Len: g.Len}
	}
	return out
}

// One layer of consecutive slots is one pitched DMA per staging chunk.
func TestPackPitched(t *testing.T) {
	const chunk, seg, layers = 1 << 20, 32 << 10, 4
	const host, slot = 0x7000000, 2 * layers * seg
	staging := []cuda.DevicePtr{0x10000000, 0x10000000 + chunk}
	hosts := &hostTable{ranges: []hostRange{{base: host, size: 64 << 20, dev: host}}}
	seq := func(n int) []int {
		s := make([]int, n)
		for i := range s {
			s[i] = i
		}
		return s
	}
	segs := layerSegs(host, 1<<40, seq(8), seq(8), layers, 3, seg)
	pack := func(segs []Segment, minRow uint64, hosts *hostTable) []gatherPiece {
		_, ps := packStaged(H2D, segs, chunkParts(segs, chunk), staging, hosts, minRow, DefaultGatherMinRun, nil)
		return ps
	}
	row := uint64(2 * seg)
	require.Equal(t, []gatherPiece{{host: host + 3*row, staging: 0x10000000, len: row, rows: 8, pitch: slot}}, pack(segs, row, hosts))
	require.Len(t, pack(segs, 2*row, hosts), 8, "rows shorter than minRow go one by one")
	require.Len(t, pack(segs, 0, hosts), 8, "minRow 0: no pitched DMAs")
	// A slot out of step ends the rows: slots 0 1 2 then 5 6.
	ps := pack(layerSegs(host, 1<<40, []int{0, 1, 2, 5, 6}, seq(5), layers, 1, seg), row, hosts)
	require.Equal(t, []gatherPiece{
		{host: host + row, staging: 0x10000000, len: row, rows: 3, pitch: slot},
		{host: host + 5*slot + row, staging: 0x10000000 + 3*row, len: row, rows: 2, pitch: slot},
	}, ps)
	// Slots going down are never rows of one DMA.
	require.Len(t, pack(layerSegs(host, 1<<40, []int{3, 2, 1, 0}, seq(4), layers, 0, seg), row, hosts), 4)
	// 24 rows of 64 KiB: 16 fill the first 1 MiB chunk, 8 the second.
	ps = pack(layerSegs(host, 1<<40, seq(24), seq(24), layers, 2, seg), row, hosts)
	require.Equal(t, []gatherPiece{
		{host: host + 2*row, staging: 0x10000000, len: row, rows: 16, pitch: slot},
		{host: host + 16*slot + 2*row, staging: 0x10000000 + chunk, len: row, rows: 8, pitch: slot, chunk: 1},
	}, ps)
	// Runs of GatherMinRun or more keep a DMA each (whole blocks move at
	// the link's rate alone).
	var whole []Segment
	for i := range uint64(3) {
		whole = append(whole, Segment{Dst: 1<<40 + i*DefaultGatherMinRun, Src: host + 2*i*DefaultGatherMinRun, Len: DefaultGatherMinRun})
	}
	require.Len(t, pack(whole, row, hosts), 3)
	// Rows never span two registrations, nor memory in none.
	two := &hostTable{ranges: []hostRange{{base: host, size: 4 * slot, dev: host}, {base: host + 4*slot, size: 64 << 20, dev: host + 4*slot}}}
	require.Len(t, pack(segs, row, two), 2)
	require.Len(t, pack(segs, row, &hostTable{}), 16, "outside every range each segment goes alone")
}

// Per-layer loads and stores of consecutive slots through the staged path
// on the fake driver: byte-exact, one pitched DMA per chunk, and counted as
// one run by Scatterable and Gatherable (a layer's 64 KiB runs alone are
// below GatherMinRun).
func TestPitchedStagingFake(t *testing.T) {
	for _, noBatch := range []bool{false, true} {
		drv := cudatest.OpenFake(t, cudafake.Options{MaxDelay: 50_000, NoMemcpyBatch: noBatch})
		s, g := newStream(t, drv), newStream(t, drv)
		c := newCopier(t, drv, Options{PTX: fakePTX, GatherChunkBytes: 1 << 20, DescCapacity: 5, BatchMax: 3})
		off := newCopier(t, drv, Options{PTX: fakePTX, GatherChunkBytes: 1 << 20, GatherMinRow: -1})
		pitchedRoundTrip(t, drv, c, off, s, g, 24, 1<<20)
	}
}

// pitchedRoundTrip loads every layer of blocks consecutive slots (4 layers,
// 32 KiB K and V) into random device blocks with SubmitScatter, checks the
// device bytes and the pitched DMAs (one per chunk of chunk bytes), then
// gathers each layer into a second host buffer and checks it. off is a
// copier without pitched DMAs, which must not find the layers stageable.
func pitchedRoundTrip(t *testing.T, drv cuda.Driver, c, off *Copier, s, g cuda.Stream, blocks int, chunk uint64) {
	t.Helper()
	const layers, seg = 4, 32 << 10
	n := uint64(blocks * 2 * layers * seg)
	src, back, dev := testBuffers(t, drv, n)
	knownHost(t, c, src)
	knownHost(t, c, back)
	knownHost(t, off, src)
	require.NoError(t, drv.MemsetD8(dev, 0xDD, n))
	require.NoError(t, drv.CtxSynchronize())
	slots := make([]int, blocks)
	for i := range slots {
		slots[i] = i
	}
	pd := mrand.New(mrand.NewPCG(3, 4)).Perm(blocks)
	perChunk := chunk / (2 * seg)
	for layer := range layers {
		h2d := layerSegs(addr(src), uint64(dev), slots, pd, layers, layer, seg)
		require.True(t, c.Scatterable(h2d), "layer %d", layer)
		require.False(t, off.Scatterable(h2d), "without pitched DMAs a layer's 64 KiB runs are too short to stage")
		before := c.PitchedCopies()
		tk, err := c.SubmitScatter(s, g, h2d)
		require.NoError(t, err)
		waitRetire(t, drv, c, s, tk)
		require.Equal(t, before+(uint64(blocks)+perChunk-1)/perChunk, c.PitchedCopies(), "one pitched DMA per chunk")
	}
	got := hostMem(t, drv, n)
	require.NoError(t, drv.Memcpy(cuda.DevicePtr(addr(got)), dev, n))
	for layer := range layers {
		for i, sg := range layerSegs(addr(src), uint64(dev), slots, pd, layers, layer, seg) {
			h, d := sg.Src-addr(src), sg.Dst-uint64(dev)
			if !bytes.Equal(src[h:h+sg.Len], got[d:d+sg.Len]) {
				t.Fatalf("layer %d segment %d (host offset %d, device offset %d) differs", layer, i, h, d)
			}
		}
	}
	// And back: each layer gathered into the second host buffer's slots,
	// which then equal the first's.
	for layer := range layers {
		d2h := swapped(layerSegs(addr(src), uint64(dev), slots, pd, layers, layer, seg), addr(src), addr(back))
		require.True(t, c.Gatherable(d2h))
		tk, err := c.SubmitGather(g, s, d2h)
		require.NoError(t, err)
		waitRetire(t, drv, c, s, tk)
	}
	if i := firstDiff(src, back); i >= 0 {
		t.Fatalf("gathered layers: byte %d differs", i)
	}
}
