package kvcache

import (
	"errors"
	"fmt"
	"math/bits"
)

// Layout errors. Every error a layout returns wraps one of these and names the
// bad value and the limit it broke.
var (
	// ErrGeometry: a zero or negative dimension, or a block size that
	// overflows 64 bits.
	ErrGeometry = errors.New("kvcache: invalid geometry")
	// ErrLayout: a malformed layout description (wrong number of layers, a
	// stride smaller than the segment, overlapping K and V, an address that
	// overflows 64 bits).
	ErrLayout = errors.New("kvcache: invalid layout")
	// ErrBlockID: a block id outside [0, NumBlocks).
	ErrBlockID = errors.New("kvcache: block id out of range")
)

// SegmentAlign is the alignment of every segment's offset inside a slot: 16
// bytes, the width of the vector loads and stores of the copy kernel. Real
// geometries (head dim 64–576, 2-byte dtypes, 16 or more tokens) have segment
// lengths that are multiples of 16 already, so no padding appears there.
const SegmentAlign = 16

// Geometry is the shape of one block of the serving stack's KV cache.
type Geometry struct {
	Layers         int // attention layers
	KVHeads        int // KV heads per layer (on this tensor-parallel rank); 1 for MLA
	HeadDim        int // elements per head (for MLA: the latent width, e.g. 576)
	DTypeBytes     int // bytes per element (2 for bf16/fp16, 1 for fp8)
	TokensPerBlock int // tokens per block
}

// Presets: plain numbers for common geometries (one tensor-parallel rank).
var (
	// Llama3_8B is a Llama-3-8B-like geometry: 32 layers, 8 KV heads of 128,
	// bf16, 16 tokens per block: 32 KiB segments, 2 MiB per block
	// layer-separate.
	Llama3_8B = Geometry{Layers: 32, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, TokensPerBlock: 16}
	// Llama3_70B is a Llama-3-70B-like geometry: 80 layers, 8 KV heads of
	// 128, bf16, 16 tokens per block: 32 KiB segments, 5 MiB per block.
	Llama3_70B = Geometry{Layers: 80, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, TokensPerBlock: 16}
	// DeepSeekMLA is a DeepSeek-V3-like MLA geometry: 61 layers, one latent
	// of 576 (512 + 64 rope), bf16, 64 tokens per block: 72 KiB per layer.
	DeepSeekMLA = Geometry{Layers: 61, KVHeads: 1, HeadDim: 576, DTypeBytes: 2, TokensPerBlock: 64}
)

// MaxLayers bounds Geometry.Layers: a layout holds one entry per layer
// (and DenseSpec builds them), so an absurd layer count must fail on the
// count, not on an allocation. Real models have at most a few hundred.
const MaxLayers = 1 << 16

// SegmentLen returns the bytes of one layer's K (or V) of one block:
// KVHeads × HeadDim × DTypeBytes × TokensPerBlock. It also checks Layers
// (at least 1, at most MaxLayers).
func (g Geometry) SegmentLen() (uint64, error) {
	dims := []struct {
		name string
		v    int
	}{
		{"Layers", g.Layers}, {"KVHeads", g.KVHeads}, {"HeadDim", g.HeadDim},
		{"DTypeBytes", g.DTypeBytes}, {"TokensPerBlock", g.TokensPerBlock},
	}
	for _, d := range dims {
		if d.v <= 0 {
			return 0, fmt.Errorf("%w: %s = %d, must be at least 1", ErrGeometry, d.name, d.v)
		}
	}
	if g.Layers > MaxLayers {
		return 0, fmt.Errorf("%w: Layers = %d, at most %d", ErrGeometry, g.Layers, MaxLayers)
	}
	n := uint64(1)
	for _, d := range dims[1:] {
		hi, lo := bits.Mul64(n, uint64(d.v))
		if hi != 0 {
			return 0, fmt.Errorf("%w: segment size %d × %s %d overflows 64 bits", ErrGeometry, n, d.name, d.v)
		}
		n = lo
	}
	return n, nil
}

// LayoutKind says how the blocks of a KV cache sit in device memory.
type LayoutKind uint8

// Layout kinds.
const (
	// LayerSeparate: per layer a K and a V tensor (or one tensor holding
	// both), each block at base + id × stride. 2 × Layers segments per block
	// (vLLM's classic layout, SGLang's layer-first one).
	LayerSeparate LayoutKind = iota + 1
	// CrossLayer: the whole block (all layers, K and V) is contiguous at
	// base + id × stride. One segment per block (vLLM's cross-layer layout,
	// Dynamo's fully contiguous one).
	CrossLayer
	// MLA: per layer one latent tensor (K only), each block at
	// base + id × stride. Layers segments per block.
	MLA
)

func (k LayoutKind) String() string {
	switch k {
	case LayerSeparate:
		return "layer-separate"
	case CrossLayer:
		return "cross-layer"
	case MLA:
		return "mla"
	}
	return fmt.Sprintf("LayoutKind(%d)", uint8(k))
}

// LayerTensors locates one layer's tensors in device memory: block b's K is
// at K + b×Stride and its V at V + b×Stride. For one tensor holding K and V,
// set V = K + the K/V offset (e.g. K + NumBlocks×Stride for a [2, blocks, ...]
// tensor, or K + SegmentLen with Stride = 2×SegmentLen for [blocks, 2, ...]).
// For MLA, V must be 0.
type LayerTensors struct {
	K, V   uint64 // device addresses of block 0's K and V
	Stride uint64 // bytes from one block to the next
}

// LayoutSpec describes a layout; NewLayout validates it.
type LayoutSpec struct {
	Kind      LayoutKind
	Geometry  Geometry
	NumBlocks int // blocks in the GPU cache; block ids are [0, NumBlocks)
	// Layers: one entry per layer, for LayerSeparate and MLA.
	Layers []LayerTensors
	// Base and Stride: for CrossLayer, block b is at Base + b×Stride.
	Base, Stride uint64
}

// Segment is one contiguous piece of a block: Len bytes at device address
// Dev, stored at byte offset Off inside the block's slot. Layer is the
// layer it belongs to (-1 for a cross-layer segment, which spans all layers).
type Segment struct {
	Dev   uint64
	Off   uint64
	Len   uint64
	Layer int
}

// Layout maps block ids to their segments and knows the slot size. It is
// immutable and safe for concurrent use.
type Layout struct {
	spec     LayoutSpec
	segLen   uint64 // one layer's K (or V); for CrossLayer the whole block
	segSpan  uint64 // segLen rounded up to SegmentAlign
	slotSize uint64
	perBlock int // segments per block
}

// NewLayout validates spec and returns its layout. Errors wrap ErrGeometry or
// ErrLayout and name the bad value and its limit.
func NewLayout(spec LayoutSpec) (*Layout, error) {
	segLen, err := spec.Geometry.SegmentLen()
	if err != nil {
		return nil, err
	}
	if spec.NumBlocks <= 0 {
		return nil, fmt.Errorf("%w: NumBlocks = %d, must be at least 1", ErrLayout, spec.NumBlocks)
	}
	g := spec.Geometry
	if spec.Kind == MLA && g.KVHeads != 1 {
		return nil, fmt.Errorf("%w: KVHeads = %d, an MLA layout has one latent per layer (must be 1)", ErrGeometry, g.KVHeads)
	}
	l := &Layout{spec: spec, segLen: segLen}
	l.spec.Layers = append([]LayerTensors(nil), spec.Layers...)
	segSpan, ok := alignUp(segLen, SegmentAlign)
	if !ok {
		return nil, fmt.Errorf("%w: segment size %d overflows 64 bits when aligned", ErrGeometry, segLen)
	}
	l.segSpan = segSpan
	switch spec.Kind {
	case LayerSeparate, MLA:
		if len(spec.Layers) != g.Layers {
			return nil, fmt.Errorf("%w: %d layer tensors given, geometry has %d layers", ErrLayout, len(spec.Layers), g.Layers)
		}
		perLayer := uint64(2)
		if spec.Kind == MLA {
			perLayer = 1
		}
		hi, n := bits.Mul64(segSpan, perLayer*uint64(g.Layers))
		if hi != 0 {
			return nil, fmt.Errorf("%w: slot size %d × %d segments overflows 64 bits", ErrGeometry, segSpan, perLayer*uint64(g.Layers))
		}
		l.slotSize = n
		l.perBlock = int(perLayer) * g.Layers
		for i, lt := range spec.Layers {
			if err := l.checkLayer(i, lt); err != nil {
				return nil, err
			}
		}
	case CrossLayer:
		perLayer := uint64(2)
		hi, n := bits.Mul64(segLen, perLayer*uint64(g.Layers))
		if hi != 0 {
			return nil, fmt.Errorf("%w: block size %d × %d overflows 64 bits", ErrGeometry, segLen, perLayer*uint64(g.Layers))
		}
		if len(spec.Layers) != 0 {
			return nil, fmt.Errorf("%w: cross-layer layout takes Base and Stride, not %d layer tensors", ErrLayout, len(spec.Layers))
		}
		l.segLen = n
		l.slotSize = n
		l.perBlock = 1
		if err := l.checkTensor("block", spec.Base, spec.Stride, n); err != nil {
			return nil, err
		}
	default:
		return nil, fmt.Errorf("%w: unknown kind %d", ErrLayout, uint8(spec.Kind))
	}
	return l, nil
}

func (l *Layout) checkLayer(i int, lt LayerTensors) error {
	name := fmt.Sprintf("layer %d K", i)
	if err := l.checkTensor(name, lt.K, lt.Stride, l.segLen); err != nil {
		return err
	}
	if l.spec.Kind == MLA {
		if lt.V != 0 {
			return fmt.Errorf("%w: layer %d V = %#x, an MLA layout has no V tensor (must be 0)", ErrLayout, i, lt.V)
		}
		return nil
	}
	if err := l.checkTensor(fmt.Sprintf("layer %d V", i), lt.V, lt.Stride, l.segLen); err != nil {
		return err
	}
	// K and V of the layer must not overlap: either their spans are
	// disjoint, or they interleave with the same stride and at least a
	// segment between them.
	span := (uint64(l.spec.NumBlocks)-1)*lt.Stride + l.segLen
	lo, hi := lt.K, lt.V
	if lo > hi {
		lo, hi = hi, lo
	}
	d := hi - lo
	if d >= span {
		return nil
	}
	r := d % lt.Stride
	if r >= l.segLen && lt.Stride-r >= l.segLen {
		return nil
	}
	return fmt.Errorf("%w: layer %d K %#x and V %#x overlap (distance %d, stride %d, segment %d)", ErrLayout, i, lt.K, lt.V, d, lt.Stride, l.segLen)
}

// checkTensor checks that a tensor of NumBlocks blocks of segLen bytes every
// stride bytes from base fits in 64-bit addresses.
func (l *Layout) checkTensor(name string, base, stride, segLen uint64) error {
	if stride < segLen {
		return fmt.Errorf("%w: %s stride %d is smaller than the segment (%d bytes)", ErrLayout, name, stride, segLen)
	}
	hi, off := bits.Mul64(uint64(l.spec.NumBlocks-1), stride)
	if hi != 0 {
		return fmt.Errorf("%w: %s: %d blocks × stride %d overflows 64 bits", ErrLayout, name, l.spec.NumBlocks, stride)
	}
	end, c := bits.Add64(off, segLen, 0)
	if c == 0 {
		_, c = bits.Add64(base, end, 0)
	}
	if c != 0 {
		return fmt.Errorf("%w: %s at %#x + %d bytes overflows 64-bit addresses", ErrLayout, name, base, end)
	}
	return nil
}

// Kind returns the layout's kind.
func (l *Layout) Kind() LayoutKind { return l.spec.Kind }

// Geometry returns the layout's geometry.
func (l *Layout) Geometry() Geometry { return l.spec.Geometry }

// NumBlocks returns the number of blocks of the GPU cache.
func (l *Layout) NumBlocks() int { return l.spec.NumBlocks }

// SlotSize returns the bytes of host storage one block needs: the sum of its
// segments, each starting at a multiple of SegmentAlign.
func (l *Layout) SlotSize() uint64 { return l.slotSize }

// SegmentsPerBlock returns how many segments every block has: 2 × Layers
// (layer-separate), Layers (MLA) or 1 (cross-layer).
func (l *Layout) SegmentsPerBlock() int { return l.perBlock }

// CheckBlock returns an error wrapping ErrBlockID if id is not a block id of
// the layout.
func (l *Layout) CheckBlock(id int) error {
	if id < 0 || id >= l.spec.NumBlocks {
		return fmt.Errorf("%w: block id %d, layout has %d blocks", ErrBlockID, id, l.spec.NumBlocks)
	}
	return nil
}

// Segments appends the segments of block id to dst and returns it. In the
// slot, layer-separate blocks are stored layer by layer, K then V; segments
// come in that order, ascending by Off. dst is unchanged on error.
func (l *Layout) Segments(id int, dst []Segment) ([]Segment, error) {
	if err := l.CheckBlock(id); err != nil {
		return dst, err
	}
	b := uint64(id)
	switch l.spec.Kind {
	case CrossLayer:
		return append(dst, Segment{Dev: l.spec.Base + b*l.spec.Stride, Off: 0, Len: l.segLen, Layer: -1}), nil
	case MLA:
		for i, lt := range l.spec.Layers {
			dst = append(dst, Segment{Dev: lt.K + b*lt.Stride, Off: uint64(i) * l.segSpan, Len: l.segLen, Layer: i})
		}
		return dst, nil
	default:
		for i, lt := range l.spec.Layers {
			off := uint64(2*i) * l.segSpan
			dst = append(dst,
				Segment{Dev: lt.K + b*lt.Stride, Off: off, Len: l.segLen, Layer: i},
				Segment{Dev: lt.V + b*lt.Stride, Off: off + l.segSpan, Len: l.segLen, Layer: i})
		}
		return dst, nil
	}
}

// alignUp rounds n up to a multiple of a (a power of two); ok is false on
// overflow.
func alignUp(n, a uint64) (uint64, bool) {
	r, c := bits.Add64(n, a-1, 0)
	if c != 0 {
		return 0, false
	}
	return r &^ (a - 1), true
}

// DenseSpec returns a spec of the given kind whose tensors lie back to back
// from base, as an allocator that gives each tensor its own buffer would place
// them: per layer a K tensor of NumBlocks × SegmentLen bytes then a V tensor
// (LayerSeparate), one latent tensor per layer (MLA), or one tensor of whole
// blocks (CrossLayer). It is for tests, demos and benchmarks; NewLayout
// validates the result.
func DenseSpec(kind LayoutKind, g Geometry, numBlocks int, base uint64) LayoutSpec {
	spec := LayoutSpec{Kind: kind, Geometry: g, NumBlocks: numBlocks}
	seg, err := g.SegmentLen()
	if err != nil || numBlocks <= 0 {
		return spec
	}
	n := uint64(numBlocks)
	switch kind {
	case CrossLayer:
		spec.Base, spec.Stride = base, 2*uint64(g.Layers)*seg
	case MLA:
		for i := 0; i < g.Layers; i++ {
			spec.Layers = append(spec.Layers, LayerTensors{K: base + uint64(i)*n*seg, Stride: seg})
		}
	default:
		for i := 0; i < g.Layers; i++ {
			k := base + uint64(2*i)*n*seg
			spec.Layers = append(spec.Layers, LayerTensors{K: k, V: k + n*seg, Stride: seg})
		}
	}
	return spec
}

// LayerSegments appends the segments of block id that belong to layer
// (K then V; the latent for MLA) to dst and returns it: the segments of
// Segments whose Layer is layer, computed directly. A cross-layer block
// has no per-layer segments: every layer gives its one segment at layer 0
// and none at others. dst is unchanged on error.
func (l *Layout) LayerSegments(id, layer int, dst []Segment) ([]Segment, error) {
	if err := l.CheckBlock(id); err != nil {
		return dst, err
	}
	if layer < 0 || layer >= l.spec.Geometry.Layers {
		return dst, fmt.Errorf("%w: layer %d, the geometry has %d layers", ErrLayout, layer, l.spec.Geometry.Layers)
	}
	b := uint64(id)
	switch l.spec.Kind {
	case CrossLayer:
		if layer != 0 {
			return dst, nil
		}
		return append(dst, Segment{Dev: l.spec.Base + b*l.spec.Stride, Off: 0, Len: l.segLen, Layer: -1}), nil
	case MLA:
		lt := l.spec.Layers[layer]
		return append(dst, Segment{Dev: lt.K + b*lt.Stride, Off: uint64(layer) * l.segSpan, Len: l.segLen, Layer: layer}), nil
	default:
		lt := l.spec.Layers[layer]
		off := uint64(2*layer) * l.segSpan
		return append(dst,
			Segment{Dev: lt.K + b*lt.Stride, Off: off, Len: l.segLen, Layer: layer},
			Segment{Dev: lt.V + b*lt.Stride, Off: off + l.segSpan, Len: l.segLen, Layer: layer}), nil
	}
}
