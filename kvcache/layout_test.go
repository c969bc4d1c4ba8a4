package kvcache

import (
	"errors"
	"slices"
	"sort"
	"testing"

	"github.com/stretchr/testify/require"
)

var presets = map[string]Geometry{"llama3-8b": llama3_8B, "llama3-70b": llama3_70B, "deepseek-mla": deepSeekMLA}

func kindsFor(g Geometry) []LayoutKind {
	if g.KVHeads == 1 {
		return []LayoutKind{MLA, CrossLayer}
	}
	return []LayoutKind{LayerSeparate, CrossLayer}
}

func TestPresetSizes(t *testing.T) {
	l8, err := NewLayout(denseSpec(LayerSeparate, llama3_8B, 4, 1<<40))
	require.NoError(t, err)
	require.Equal(t, uint64(2<<20), l8.SlotSize())
	require.Equal(t, 64, l8.segmentsPerBlock())
	l70, err := NewLayout(denseSpec(LayerSeparate, llama3_70B, 4, 1<<40))
	require.NoError(t, err)
	require.Equal(t, uint64(5<<20), l70.SlotSize())
	mla, err := NewLayout(denseSpec(MLA, deepSeekMLA, 4, 1<<40))
	require.NoError(t, err)
	require.Equal(t, uint64(61*64*576*2), mla.SlotSize())
	require.Equal(t, 61, mla.segmentsPerBlock())
}

// Every block of every preset and kind: segments sum to the slot size, do
// not overlap in the slot, are aligned, and no two blocks share device bytes.
func TestSegmentsEveryBlock(t *testing.T) {
	const blocks = 64
	for name, g := range presets {
		for _, kind := range kindsFor(g) {
			t.Run(name+"/"+kind.String(), func(t *testing.T) {
				l, err := NewLayout(denseSpec(kind, g, blocks, 1<<40))
				require.NoError(t, err)
				type span struct{ lo, hi uint64 }
				var dev []span
				var segs []Segment
				for b := 0; b < blocks; b++ {
					segs, err = l.Segments(b, segs[:0])
					require.NoError(t, err)
					require.Len(t, segs, l.segmentsPerBlock())
					var sum, end uint64
					for _, s := range segs {
						require.Zero(t, s.Off%segmentAlign, "segment offset %d", s.Off)
						require.GreaterOrEqual(t, s.Off, end, "segments overlap in the slot")
						end = s.Off + s.Len
						sum += s.Len
						dev = append(dev, span{s.Dev, s.Dev + s.Len})
					}
					require.LessOrEqual(t, end, l.SlotSize())
					require.Equal(t, l.SlotSize(), sum)
				}
				sort.Slice(dev, func(i, j int) bool { return dev[i].lo < dev[j].lo })
				for i := 1; i < len(dev); i++ {
					require.LessOrEqual(t, dev[i-1].hi, dev[i].lo, "device segments overlap")
				}
			})
		}
	}
}

func TestSegmentPadding(t *testing.T) {
	g := Geometry{Layers: 2, KVHeads: 1, HeadDim: 3, DTypeBytes: 1, TokensPerBlock: 3} // 9-byte segments
	l, err := NewLayout(denseSpec(LayerSeparate, g, 2, 0))
	require.NoError(t, err)
	require.Equal(t, uint64(4*16), l.SlotSize())
	segs, err := l.Segments(1, nil)
	require.NoError(t, err)
	require.Equal(t, []Segment{
		{Dev: 9, Off: 0, Len: 9, Layer: 0}, {Dev: 27, Off: 16, Len: 9, Layer: 0},
		{Dev: 45, Off: 32, Len: 9, Layer: 1}, {Dev: 63, Off: 48, Len: 9, Layer: 1},
	}, segs)
}

func TestCombinedKV(t *testing.T) {
	g := Geometry{Layers: 1, KVHeads: 2, HeadDim: 4, DTypeBytes: 2, TokensPerBlock: 2} // 32-byte segments
	// [blocks, 2, ...]: V right after K, stride two segments.
	l, err := NewLayout(LayoutSpec{Kind: LayerSeparate, Geometry: g, NumBlocks: 3,
		Layers: []LayerTensors{{K: 1000, V: 1032, Stride: 64}}})
	require.NoError(t, err)
	segs, err := l.Segments(2, nil)
	require.NoError(t, err)
	require.Equal(t, uint64(1128), segs[0].Dev)
	require.Equal(t, uint64(1160), segs[1].Dev)
}

func TestLayoutErrors(t *testing.T) {
	g := llama3_8B
	seg := uint64(32768)
	two := []LayerTensors{{K: 0, V: 1 << 30, Stride: seg}}
	cases := []struct {
		name string
		spec LayoutSpec
		err  error
		msg  string
	}{
		{"zero layers", LayoutSpec{Kind: CrossLayer, Geometry: Geometry{0, 8, 128, 2, 16}, NumBlocks: 1, Stride: 1 << 30}, errGeometry, "Layers = 0"},
		{"negative head dim", LayoutSpec{Kind: CrossLayer, Geometry: Geometry{1, 8, -1, 2, 16}, NumBlocks: 1, Stride: 1 << 30}, errGeometry, "HeadDim = -1"},
		{"overflow", LayoutSpec{Kind: CrossLayer, Geometry: Geometry{1, 1 << 30, 1 << 30, 1 << 30, 16}, NumBlocks: 1}, errGeometry, "overflows"},
		{"zero blocks", LayoutSpec{Kind: CrossLayer, Geometry: g, NumBlocks: 0}, errLayout, "NumBlocks = 0"},
		{"layer count", LayoutSpec{Kind: LayerSeparate, Geometry: g, NumBlocks: 1, Layers: two}, errLayout, "1 layer tensors given, geometry has 32"},
		{"stride", LayoutSpec{Kind: CrossLayer, Geometry: g, NumBlocks: 2, Stride: 100}, errLayout, "stride 100 is smaller than the segment (2097152"},
		{"address overflow", LayoutSpec{Kind: CrossLayer, Geometry: g, NumBlocks: 2, Base: ^uint64(0) - 10, Stride: 2 << 20}, errLayout, "overflows 64-bit"},
		{"kv overlap", LayoutSpec{Kind: LayerSeparate, Geometry: Geometry{1, 8, 128, 2, 16}, NumBlocks: 4,
			Layers: []LayerTensors{{K: 0, V: seg / 2, Stride: seg}}}, errLayout, "overlap"},
		{"mla with V", LayoutSpec{Kind: MLA, Geometry: Geometry{1, 1, 576, 2, 16}, NumBlocks: 4,
			Layers: []LayerTensors{{K: 0, V: 1 << 30, Stride: 1 << 20}}}, errLayout, "no V tensor"},
		{"unknown kind", LayoutSpec{Kind: 9, Geometry: g, NumBlocks: 1}, errLayout, "unknown kind 9"},
		{"cross-layer with layers", LayoutSpec{Kind: CrossLayer, Geometry: Geometry{1, 8, 128, 2, 16}, NumBlocks: 1, Stride: 1 << 20, Layers: two}, errLayout, "not 1 layer tensors"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewLayout(tc.spec)
			require.ErrorIs(t, err, tc.err)
			require.ErrorContains(t, err, tc.msg)
		})
	}
}

func TestBlockIDRange(t *testing.T) {
	l, err := NewLayout(denseSpec(CrossLayer, llama3_8B, 10, 0))
	require.NoError(t, err)
	for _, id := range []int{-1, 10, 1 << 40} {
		dst := []Segment{{Len: 7}}
		got, err := l.Segments(id, dst)
		require.ErrorIs(t, err, errBlockID)
		require.ErrorContains(t, err, "layout has 10 blocks")
		require.Equal(t, dst, got)
	}
}

func FuzzLayout(f *testing.F) {
	f.Add(uint8(1), 2, 8, 128, 2, 16, 10, uint64(0), uint64(1<<20), uint64(32768), 5)
	f.Add(uint8(2), 32, 8, 128, 2, 16, 100, uint64(1<<40), uint64(0), uint64(2<<20), 99)
	f.Add(uint8(3), 3, 1, 576, 2, 64, 4, uint64(0), uint64(0), uint64(73728), 0)
	f.Add(uint8(1), 1, 1, 1, 1, 1, 1, uint64(0), uint64(0), uint64(0), -1)
	f.Fuzz(func(t *testing.T, kind uint8, layers, heads, dim, dt, tpb, blocks int, base, vOff, stride uint64, block int) {
		if layers > 256 || layers < -1 {
			return // keep the layer list small
		}
		spec := LayoutSpec{Kind: LayoutKind(kind), Geometry: Geometry{layers, heads, dim, dt, tpb}, NumBlocks: blocks, Base: base, Stride: stride}
		if spec.Kind != CrossLayer && layers > 0 {
			for i := 0; i < layers; i++ {
				lt := LayerTensors{K: base + uint64(i)*vOff*2, Stride: stride}
				if spec.Kind != MLA {
					lt.V = lt.K + vOff
				}
				spec.Layers = append(spec.Layers, lt)
			}
		}
		l, err := NewLayout(spec)
		if err != nil {
			require.True(t, isAny(err, errGeometry, errLayout), "unexpected error %v", err)
			return
		}
		segs, err := l.Segments(block, nil)
		if err != nil {
			require.ErrorIs(t, err, errBlockID)
			require.True(t, block < 0 || block >= blocks)
			return
		}
		var sum, end uint64
		for _, s := range segs {
			require.GreaterOrEqual(t, s.Off, end)
			require.Zero(t, s.Off%segmentAlign)
			end = s.Off + s.Len
			sum += s.Len
			require.GreaterOrEqual(t, s.Dev+s.Len, s.Dev, "device address overflow")
		}
		require.LessOrEqual(t, end, l.SlotSize())
		require.LessOrEqual(t, sum, l.SlotSize())
	})
}

// TestLayerSegments: LayerSegments gives exactly Segments' segments of each
// layer, in order, for every kind.
func TestLayerSegments(t *testing.T) {
	g := Geometry{Layers: 3, KVHeads: 2, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16}
	for _, kind := range []LayoutKind{LayerSeparate, CrossLayer, MLA} {
		gg := g
		if kind == MLA {
			gg.KVHeads = 1
		}
		l, err := NewLayout(denseSpec(kind, gg, 5, 1<<20))
		if err != nil {
			t.Fatal(err)
		}
		for id := range 5 {
			all, err := l.Segments(id, nil)
			if err != nil {
				t.Fatal(err)
			}
			var got []Segment
			for layer := range gg.Layers {
				got, err = l.LayerSegments(id, layer, got)
				if err != nil {
					t.Fatal(err)
				}
			}
			if !slices.Equal(all, got) {
				t.Fatalf("%v block %d: LayerSegments %v, Segments %v", kind, id, got, all)
			}
		}
		if _, err := l.LayerSegments(5, 0, nil); !errors.Is(err, errBlockID) {
			t.Fatalf("%v: block 5 of 5: %v", kind, err)
		}
		if _, err := l.LayerSegments(0, gg.Layers, nil); !errors.Is(err, errLayout) {
			t.Fatalf("%v: layer %d: %v", kind, gg.Layers, err)
		}
	}
}

// denseSpec returns a spec of the given kind whose tensors lie back to back
// from base, as an allocator that gives each tensor its own buffer would place
// them: per layer a K tensor of NumBlocks blocks (one layer's K each) then a V tensor
// (LayerSeparate), one latent tensor per layer (MLA), or one tensor of whole
// blocks (CrossLayer). It is for tests, demos and benchmarks; NewLayout
// validates the result.
func denseSpec(kind LayoutKind, g Geometry, numBlocks int, base uint64) LayoutSpec {
	spec := LayoutSpec{Kind: kind, Geometry: g, NumBlocks: numBlocks}
	seg, err := g.segmentLen()
	if err != nil || numBlocks <= 0 {
		return spec
	}
	return denseTensors(spec, seg, base)
}
