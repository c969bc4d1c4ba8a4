package kvcache

import (
	"bytes"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

// tpGeo is a small model: 2 layers, 4 KV heads of 4 elements of 2 bytes,
// 3 tokens per block (24-byte heads, 96-byte layer segments).
var tpGeo = Geometry{Layers: 2, KVHeads: 4, HeadDim: 4, DTypeBytes: 2, TokensPerBlock: 3}

// rankHeads is the head range rank r of tp holds: an equal share, or, when
// tp exceeds the heads, one head replicated on tp/heads ranks.
func rankHeads(heads, tp, r int) HeadRange {
	if tp > heads {
		return HeadRange{First: r * heads / tp, Count: 1}
	}
	n := heads / tp
	return HeadRange{First: r * n, Count: n}
}

// kvByte is the model's KV: byte e of element (block, layer, kv, token,
// head, elem). The test's own model, not the layout's formulas.
func kvByte(block, layer, kv, tok, head, elemByte int) byte {
	return byte(block*131 + layer*37 + kv*17 + tok*11 + head*5 + elemByte*3 + 1)
}

// devTensor is one rank's GPU cache for the test: memory at base, filled
// (by fill) with the KV of its heads in its order, independently of
// Segments.
type devTensor struct {
	l    *Layout
	base uint64
	mem  []byte
}

const devBase = 1 << 20

func newDevTensor(t *testing.T, kind LayoutKind, g Geometry, order HeadOrder, heads HeadRange, blocks int) *devTensor {
	t.Helper()
	l, err := NewLayout(DenseRankSpec(kind, g, order, heads, blocks, devBase))
	require.NoError(t, err)
	return &devTensor{l: l, base: devBase, mem: make([]byte, int(l.RankBytes())*blocks)}
}

// at returns the index in mem of byte e of (block, layer, kv, token, local head).
func (d *devTensor) at(b, i, kv, tok, lh, e int) int {
	g := d.l.Geometry()
	n := d.l.Heads().Count
	var inSeg int
	if d.l.Order() == TokenMajor {
		inSeg = ((tok*n+lh)*g.HeadDim)*g.DTypeBytes + e
	} else {
		inSeg = ((lh*g.TokensPerBlock+tok)*g.HeadDim)*g.DTypeBytes + e
	}
	seg := int(d.l.devSeg)
	kvs := d.l.kvPerLayer()
	blocks := d.l.numBlocks()
	if d.l.Kind() == CrossLayer {
		return b*kvs*g.Layers*seg + (i*kvs+kv)*seg + inSeg
	}
	// DenseRankSpec: per layer K tensor then V tensor of blocks × seg.
	return (i*kvs+kv)*blocks*seg + b*seg + inSeg
}

func (d *devTensor) each(f func(b, i, kv, tok, h, lh, e int)) {
	g := d.l.Geometry()
	for b := 0; b < d.l.numBlocks(); b++ {
		for i := 0; i < g.Layers; i++ {
			for kv := 0; kv < d.l.kvPerLayer(); kv++ {
				for tok := 0; tok < g.TokensPerBlock; tok++ {
					for lh := 0; lh < d.l.Heads().Count; lh++ {
						for e := 0; e < g.HeadDim*g.DTypeBytes; e++ {
							f(b, i, kv, tok, d.l.Heads().First+lh, lh, e)
						}
					}
				}
			}
		}
	}
}

func (d *devTensor) fill() {
	d.each(func(b, i, kv, tok, h, lh, e int) { d.mem[d.at(b, i, kv, tok, lh, e)] = kvByte(b, i, kv, tok, h, e) })
}

// check reports the first byte of the device that does not hold the KV.
func (d *devTensor) check() error {
	var err error
	d.each(func(b, i, kv, tok, h, lh, e int) {
		if got, want := d.mem[d.at(b, i, kv, tok, lh, e)], kvByte(b, i, kv, tok, h, e); err == nil && got != want {
			err = fmt.Errorf("block %d layer %d kv %d token %d head %d byte %d: %#x, want %#x", b, i, kv, tok, h, e, got, want)
		}
	})
	return err
}

// copySegs applies segs of one block between the device and slot, as a copy
// engine would: store (device → slot) or load (slot → device).
func (d *devTensor) copySegs(t *testing.T, segs []Segment, slot []byte, store bool) {
	t.Helper()
	for _, s := range segs {
		rows, row := uint64(1), s.Len
		if s.Rows > 1 {
			require.Equal(t, s.Len, s.Rows*s.RowLen, "2-D segment %+v", s)
			require.GreaterOrEqual(t, s.DevPitch, s.RowLen)
			require.GreaterOrEqual(t, s.HostPitch, s.RowLen)
			rows, row = s.Rows, s.RowLen
		} else {
			require.Zero(t, s.RowLen|s.DevPitch|s.HostPitch, "1-D segment %+v", s)
		}
		for r := uint64(0); r < rows; r++ {
			dv := d.mem[s.Dev-d.base+r*s.DevPitch:][:row]
			hs := slot[s.Off+r*s.HostPitch:][:row]
			if store {
				copy(hs, dv)
			} else {
				copy(dv, hs)
			}
		}
	}
}

// headMajorSlot is the slot of block b in the head-major host format, built from the
// format's definition; padding holds pad.
func headMajorSlot(l *Layout, b int, pad byte) []byte {
	g := l.Geometry()
	slot := bytes.Repeat([]byte{pad}, int(l.SlotSize()))
	kvs := l.kvPerLayer()
	headBytes := g.TokensPerBlock * g.HeadDim * g.DTypeBytes
	for i := 0; i < g.Layers; i++ {
		for kv := 0; kv < kvs; kv++ {
			var base int
			if l.Kind() == CrossLayer {
				base = (i*kvs + kv) * g.KVHeads * headBytes
			} else {
				base = (i*kvs + kv) * int(l.segSpan)
			}
			for h := 0; h < g.KVHeads; h++ {
				for tok := 0; tok < g.TokensPerBlock; tok++ {
					for e := 0; e < g.HeadDim*g.DTypeBytes; e++ {
						slot[base+h*headBytes+tok*g.HeadDim*g.DTypeBytes+e] = kvByte(b, i, kv, tok, h, e)
					}
				}
			}
		}
	}
	return slot
}

// TestTPSizeSharingLayout: the ranks of one TP size store a block's heads
// into one slot, which is then the head-major slot whatever the TP size and
// device order; the ranks of every TP size and order load their heads from
// it byte for byte. Replicated heads (TP above the head count) included.
func TestTPSizeSharingLayout(t *testing.T) {
	const blocks = 3
	geos := map[string]Geometry{"gqa": tpGeo, "mla": {Layers: 3, KVHeads: 1, HeadDim: 8, DTypeBytes: 2, TokensPerBlock: 5},
		"one-token": {Layers: 1, KVHeads: 4, HeadDim: 2, DTypeBytes: 1, TokensPerBlock: 1}}
	for gname, g := range geos {
		kinds := []LayoutKind{LayerSeparate, CrossLayer}
		if g.KVHeads == 1 {
			kinds = []LayoutKind{MLA, CrossLayer}
		}
		for _, kind := range kinds {
			for _, storeOrder := range []HeadOrder{TokenMajor, HeadMajor} {
				for _, storeTP := range []int{1, 2, 4, 8} {
					t.Run(fmt.Sprintf("%s/%v/%v/tp%d", gname, kind, storeOrder, storeTP), func(t *testing.T) {
						slots := make([][]byte, blocks)
						var ref *Layout
						for r := 0; r < storeTP; r++ {
							d := newDevTensor(t, kind, g, storeOrder, rankHeads(g.KVHeads, storeTP, r), blocks)
							ref = d.l
							d.fill()
							for b := range slots {
								if slots[b] == nil {
									slots[b] = bytes.Repeat([]byte{0xEE}, int(d.l.SlotSize()))
								}
								segs, err := d.l.Segments(b, nil)
								require.NoError(t, err)
								require.Len(t, segs, d.l.segmentsPerBlock())
								d.copySegs(t, segs, slots[b], true)
							}
						}
						for b := range slots {
							require.Equal(t, headMajorSlot(ref, b, 0xEE), slots[b], "slot of block %d", b)
						}
						for _, loadOrder := range []HeadOrder{TokenMajor, HeadMajor} {
							for _, loadTP := range []int{1, 2, 4, 8} {
								for r := 0; r < loadTP; r++ {
									d := newDevTensor(t, kind, g, loadOrder, rankHeads(g.KVHeads, loadTP, r), blocks)
									for i := range d.mem {
										d.mem[i] = 0xA5 // poison
									}
									for b := range slots {
										segs, err := d.l.Segments(b, nil)
										require.NoError(t, err)
										d.copySegs(t, segs, slots[b], false)
									}
									require.NoError(t, d.check(), "load %v tp %d rank %d", loadOrder, loadTP, r)
								}
							}
						}
					})
				}
			}
		}
	}
}

// The segments of a head range cover exactly its host runs, and a whole-head
// head-major layout has the slot offsets of the undeclared layout.
func TestHostRunsMatchSegments(t *testing.T) {
	for _, kind := range []LayoutKind{LayerSeparate, CrossLayer} {
		for _, order := range []HeadOrder{TokenMajor, HeadMajor} {
			for _, heads := range []HeadRange{{0, 4}, {0, 2}, {2, 2}, {1, 1}, {3, 1}} {
				l, err := NewLayout(DenseRankSpec(kind, tpGeo, order, heads, 4, devBase))
				require.NoError(t, err)
				runs, err := l.hostRuns(heads, nil)
				require.NoError(t, err)
				require.Len(t, runs, 2*tpGeo.Layers)
				covered := map[uint64]bool{}
				segs, err := l.Segments(3, nil)
				require.NoError(t, err)
				for _, s := range segs {
					rows, row := max(s.Rows, 1), s.Len
					if s.Rows > 1 {
						row = s.RowLen
					}
					for r := uint64(0); r < rows; r++ {
						for x := uint64(0); x < row; x++ {
							require.False(t, covered[s.Off+r*s.HostPitch+x], "byte %d twice", s.Off+r*s.HostPitch+x)
							covered[s.Off+r*s.HostPitch+x] = true
						}
					}
				}
				n := 0
				for _, run := range runs {
					for x := run.Off; x < run.Off+run.Len; x++ {
						require.True(t, covered[x], "%v %v %v: run byte %d not covered", kind, order, heads, x)
						n++
					}
				}
				require.Equal(t, len(covered), n)
				require.Equal(t, l.RankBytes(), uint64(n)*uint64(len(segs))/uint64(len(segs)))
			}
		}
	}
	// Whole heads, head-major, layer-separate: the undeclared layout's segments.
	for name, g := range presets {
		kind := LayerSeparate
		if g.KVHeads == 1 {
			kind = MLA
		}
		u, err := NewLayout(denseSpec(kind, g, 8, 1<<40))
		require.NoError(t, err)
		h, err := NewLayout(DenseRankSpec(kind, g, HeadMajor, HeadRange{}, 8, 1<<40))
		require.NoError(t, err)
		require.Equal(t, u.SlotSize(), h.SlotSize(), name)
		a, err := u.Segments(5, nil)
		require.NoError(t, err)
		b, err := h.Segments(5, nil)
		require.NoError(t, err)
		require.Equal(t, a, b, name)
		require.Equal(t, OrderUndeclared, u.Order())    // slots: a byte copy of the device's segments
		require.NotEqual(t, OrderUndeclared, h.Order()) // slots: head-major
	}
}

func TestTokenMajorSegments(t *testing.T) {
	// Llama-3-8B on TP=2, rank 1: heads [4, 8), 4 2-D segments per layer K/V.
	l, err := NewLayout(DenseRankSpec(LayerSeparate, llama3_8B, TokenMajor, HeadRange{4, 4}, 16, 1<<40))
	require.NoError(t, err)
	require.Equal(t, uint64(2<<20), l.SlotSize())
	require.Equal(t, uint64(1<<20), l.RankBytes())
	require.Equal(t, 2*32*4, l.segmentsPerBlock())
	segs, err := l.Segments(2, nil)
	require.NoError(t, err)
	require.Len(t, segs, l.segmentsPerBlock())
	k0 := uint64(1<<40) + 2*16384
	require.Equal(t, Segment{Dev: k0, Off: 4 * 4096, Len: 4096, Layer: 0, Rows: 16, RowLen: 256, DevPitch: 1024, HostPitch: 256}, segs[0])
	require.Equal(t, Segment{Dev: k0 + 256, Off: 5 * 4096, Len: 4096, Layer: 0, Rows: 16, RowLen: 256, DevPitch: 1024, HostPitch: 256}, segs[1])
	require.True(t, segs[0].Rows > 1) // strided (2-D)
	// A sub-range of the rank's heads.
	sub, err := l.segmentsOfRange(2, HeadRange{6, 1}, nil)
	require.NoError(t, err)
	require.Len(t, sub, 64)
	require.Equal(t, segs[2], sub[0])
}

func TestHeadRangeErrors(t *testing.T) {
	cases := []struct {
		name  string
		order HeadOrder
		heads HeadRange
		err   error
		msg   string
	}{
		{"undeclared order with a range", OrderUndeclared, HeadRange{0, 2}, errHeadRange, "needs LayoutSpec.Order"},
		{"past the heads", TokenMajor, HeadRange{3, 2}, errHeadRange, "heads [3, 5) (first 3, count 2) outside the model's 4 KV heads"},
		{"negative first", HeadMajor, HeadRange{-1, 2}, errHeadRange, "first -1"},
		{"empty", HeadMajor, HeadRange{2, 0}, errHeadRange, "count 0"},
		{"huge count", HeadMajor, HeadRange{1, 1 << 62}, errHeadRange, "outside the model's 4 KV heads"},
		{"bad order", HeadOrder(7), HeadRange{}, errLayout, "Order = 7"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			spec := DenseRankSpec(LayerSeparate, tpGeo, HeadMajor, HeadRange{}, 2, devBase)
			spec.Order, spec.Heads = tc.order, tc.heads
			_, err := NewLayout(spec)
			require.ErrorIs(t, err, tc.err)
			require.ErrorContains(t, err, tc.msg)
		})
	}
	l, err := NewLayout(DenseRankSpec(LayerSeparate, tpGeo, TokenMajor, HeadRange{2, 2}, 2, devBase))
	require.NoError(t, err)
	dst := []Segment{{Len: 1}}
	got, err := l.segmentsOfRange(0, HeadRange{1, 2}, dst)
	require.ErrorIs(t, err, errHeadRange)
	require.ErrorContains(t, err, "hold [2, 4)")
	require.Equal(t, dst, got)
	_, err = l.hostRuns(HeadRange{0, 5}, nil)
	require.ErrorIs(t, err, errHeadRange)
	u, err := NewLayout(denseSpec(LayerSeparate, tpGeo, 2, devBase))
	require.NoError(t, err)
	_, err = u.hostRuns(HeadRange{0, 2}, nil)
	require.ErrorContains(t, err, "whole blocks only")
	runs, err := u.hostRuns(HeadRange{0, 4}, nil)
	require.NoError(t, err)
	require.Len(t, runs, 4)
	// Pipeline-parallel stages are refused; all layers is no stage.
	spec := DenseRankSpec(LayerSeparate, tpGeo, TokenMajor, HeadRange{}, 2, devBase)
	spec.Stage = LayerRange{First: 1, Count: 1}
	_, err = NewLayout(spec)
	require.ErrorIs(t, err, errLayout)
	require.ErrorContains(t, err, "Stage layers [1, 2) of 2: pipeline-parallel stages are not supported")
	spec.Stage = LayerRange{First: 0, Count: 2}
	_, err = NewLayout(spec)
	require.NoError(t, err)
	// A stride too small for the rank's heads is refused on the device size.
	spec = DenseRankSpec(LayerSeparate, tpGeo, TokenMajor, HeadRange{0, 2}, 2, devBase)
	spec.Layers[0].Stride = 47
	_, err = NewLayout(spec)
	require.ErrorIs(t, err, errLayout)
	require.ErrorContains(t, err, "smaller than the segment (48 bytes)")
}

// FuzzHeadLayout: any geometry, head range and order is an error naming
// one of the layout errors, or a layout whose segments of every head range
// inside its heads lie in the slot, add up to the range's host runs, and
// whose rank's segments add up to RankBytes.
func FuzzHeadLayout(f *testing.F) {
	f.Add(uint8(1), uint8(1), 2, 8, 128, 2, 16, 0, 4, 3)
	f.Add(uint8(2), uint8(2), 3, 4, 64, 1, 1, 1, 2, 0)
	f.Add(uint8(3), uint8(1), 3, 1, 576, 2, 64, 0, 1, 1)
	f.Add(uint8(1), uint8(0), 1, 1<<30, 1, 1, 2, 0, 0, 0)
	f.Add(uint8(1), uint8(1), 1, 1<<12, 1, 1, 2, 0, 0, 0)
	f.Fuzz(func(t *testing.T, kind, order uint8, layers, heads, dim, dt, tpb, first, count, block int) {
		if layers > 64 || layers < -1 {
			return
		}
		g := Geometry{layers, heads, dim, dt, tpb}
		spec := DenseRankSpec(LayoutKind(kind), g, HeadOrder(order), HeadRange{first, count}, 4, 1<<40)
		l, err := NewLayout(spec)
		if err != nil {
			require.True(t, isAny(err, errGeometry, errLayout, errHeadRange), "unexpected error %v", err)
			return
		}
		segs, err := l.Segments(block, nil)
		if err != nil {
			require.ErrorIs(t, err, errBlockID)
			return
		}
		var sum uint64
		for _, s := range segs {
			sum += s.Len
			if s.Rows > 1 {
				require.Equal(t, s.Len, s.Rows*s.RowLen)
				require.LessOrEqual(t, s.Off+(s.Rows-1)*s.HostPitch+s.RowLen, l.SlotSize())
			} else {
				require.LessOrEqual(t, s.Off+s.Len, l.SlotSize())
			}
		}
		require.Equal(t, l.RankBytes(), sum)
		require.Len(t, segs, l.segmentsPerBlock())
		if l.Order() != OrderUndeclared {
			runs, err := l.hostRuns(l.Heads(), nil)
			require.NoError(t, err)
			var rsum uint64
			for _, r := range runs {
				rsum += r.Len
				require.LessOrEqual(t, r.Off+r.Len, l.SlotSize())
			}
			require.Equal(t, sum, rsum)
		}
	})
}

// TestLayerSegmentsDeclaredOrder: for a layout of declared order,
// LayerSegments is the rank's segments of Segments whose Layer is the
// layer (a constant count per layer, segmentsPerBlock / Layers).
func TestLayerSegmentsDeclaredOrder(t *testing.T) {
	for _, kind := range []LayoutKind{LayerSeparate, CrossLayer} {
		for _, order := range []HeadOrder{TokenMajor, HeadMajor} {
			for _, h := range []HeadRange{{0, 4}, {2, 2}, {3, 1}} {
				l, err := NewLayout(DenseRankSpec(kind, tpGeo, order, h, 5, 1<<30))
				require.NoError(t, err)
				all, err := l.Segments(3, nil)
				require.NoError(t, err)
				per := l.segmentsPerBlock() / tpGeo.Layers
				for layer := 0; layer < tpGeo.Layers; layer++ {
					got, err := l.LayerSegments(3, layer, nil)
					require.NoError(t, err)
					require.Equal(t, all[layer*per:(layer+1)*per], got, "%v %v heads %v layer %d", kind, order, h, layer)
				}
			}
		}
	}
}
