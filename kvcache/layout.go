package kvcache

import (
	"errors"
	"fmt"
	"math/bits"
	"slices"
)

// Layout errors. Every error a layout returns wraps one of these and names the
// bad value and the limit it broke.
var (
	// errGeometry: a zero or negative dimension, or a block size that
	// overflows 64 bits.
	errGeometry = errors.New("kvcache: invalid geometry")
	// errLayout: a malformed layout description (wrong number of layers, a
	// stride smaller than the segment, overlapping K and V, an address that
	// overflows 64 bits).
	errLayout = errors.New("kvcache: invalid layout")
	// errBlockID: a block id outside [0, NumBlocks).
	errBlockID = errors.New("kvcache: block id out of range")
	// errHeadRange: a head range that is empty, outside the model's KV
	// heads, outside the heads the layout's device tensors hold, or given
	// to a layout that declares no device order (LayoutSpec.Order).
	errHeadRange = errors.New("kvcache: invalid head range")
)

// segmentAlign is the alignment of every segment's offset inside a slot: 16
// bytes, the width of the vector loads and stores of the copy kernel. Real
// geometries (head dim 64–576, 2-byte dtypes, 16 or more tokens) have segment
// lengths that are multiples of 16 already, so no padding appears there.
const segmentAlign = 16

// Geometry is the shape of one block of the model's KV cache: all its KV
// heads, whatever the tensor-parallel size (a rank's share is the layout's
// head range, LayoutSpec.Heads). Every field is at least 1; Layers is at
// most 65536, and KVHeads at most 4096 in a layout of declared order
// (LayoutSpec.Order); NewLayout refuses others.
type Geometry struct {
	Layers         int // attention layers
	KVHeads        int // the model's KV heads per layer (all ranks together); 1 for MLA
	HeadDim        int // elements per head (for MLA: the latent width, e.g. 576)
	DTypeBytes     int // bytes per element (2 for bf16/fp16, 1 for fp8)
	TokensPerBlock int // tokens per block
}

// Presets for tests: plain numbers for common geometries (one
// tensor-parallel rank).
var (
	// llama3_8B is a Llama-3-8B-like geometry: 32 layers, 8 KV heads of 128,
	// bf16, 16 tokens per block: 32 KiB segments, 2 MiB per block
	// layer-separate.
	llama3_8B = Geometry{Layers: 32, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, TokensPerBlock: 16}
	// llama3_70B is a Llama-3-70B-like geometry: 80 layers, 8 KV heads of
	// 128, bf16, 16 tokens per block: 32 KiB segments, 5 MiB per block.
	llama3_70B = Geometry{Layers: 80, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, TokensPerBlock: 16}
	// deepSeekMLA is a DeepSeek-V3-like MLA geometry: 61 layers, one latent
	// of 576 (512 + 64 rope), bf16, 64 tokens per block: 72 KiB per layer.
	deepSeekMLA = Geometry{Layers: 61, KVHeads: 1, HeadDim: 576, DTypeBytes: 2, TokensPerBlock: 64}
)

// maxLayers bounds Geometry.Layers: a layout holds one entry per layer
// (and DenseRankSpec builds them), so an absurd layer count must fail on the
// count, not on an allocation. Real models have at most a few hundred.
const maxLayers = 1 << 16

// maxKVHeads bounds Geometry.KVHeads for a layout of declared order
// (LayoutSpec.Order), which gives a segment per head: real models have at
// most a few hundred KV heads, so an absurd count must fail on the count,
// not on the segment lists it would make.
const maxKVHeads = 1 << 12

// segmentLen returns the bytes of one layer's K (or V) of one block:
// KVHeads × HeadDim × DTypeBytes × TokensPerBlock. It also checks Layers
// (at least 1, at most maxLayers).
func (g Geometry) segmentLen() (uint64, error) {
	dims := []struct {
		name string
		v    int
	}{
		{"Layers", g.Layers}, {"KVHeads", g.KVHeads}, {"HeadDim", g.HeadDim},
		{"DTypeBytes", g.DTypeBytes}, {"TokensPerBlock", g.TokensPerBlock},
	}
	for _, d := range dims {
		if d.v <= 0 {
			return 0, fmt.Errorf("%w: %s = %d, must be at least 1", errGeometry, d.name, d.v)
		}
	}
	if g.Layers > maxLayers {
		return 0, fmt.Errorf("%w: Layers = %d, at most %d", errGeometry, g.Layers, maxLayers)
	}
	n := uint64(1)
	for _, d := range dims[1:] {
		hi, lo := bits.Mul64(n, uint64(d.v))
		if hi != 0 {
			return 0, fmt.Errorf("%w: segment size %d × %s %d overflows 64 bits", errGeometry, n, d.name, d.v)
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
// tensor, or K + L with Stride = 2×L for [blocks, 2, ...], L being one
// layer's K: TokensPerBlock × KVHeads × HeadDim × DTypeBytes).
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

	// Heads is the range of the model's KV heads this rank's device tensors
	// hold, [First, First+Count): the tensors hold Count heads, in that
	// order. The zero value means every head (one rank, or a model whose
	// heads every rank replicates, as MLA's latent). A range other than all
	// heads needs Order.
	Heads HeadRange
	// Order is how a block's tokens and heads sit inside one layer's K (or
	// V) on the device. The zero value, OrderUndeclared, keeps the host
	// slot a byte copy of the device's segments (whole blocks only, the
	// host layout depends on the device's order: not shareable between
	// tensor-parallel sizes). TokenMajor or HeadMajor make the host slot
	// head-major (see the package doc), the same bytes for every TP size.
	Order HeadOrder
	// Stage is the range of the model's layers a pipeline-parallel stage
	// holds, [First, First+Count) of Geometry.Layers. Only the zero value
	// (every layer: no pipeline parallelism) is accepted: stages are
	// refused (see LayerRange).
	Stage LayerRange
}

// LayerRange is a range of a model's layers, [First, First+Count).
//
// Pipeline-parallel stages are not supported as layer ranges: a slot would
// have to hold every layer of the model while a stage writes its own, and a
// block would become complete only where every stage stores into the same
// host pool. A stage that runs anyway describes its own layers as the
// geometry and names its stage in the key namespace, so that no stage reads
// another's blocks (nothing is shared between stages).
type LayerRange struct {
	First, Count int
}

// Segment is one piece of a block: Len bytes at device address Dev, stored
// at byte offset Off inside the block's slot. Layer is the layer it belongs
// to (-1 for a cross-layer segment of an undeclared order, which spans all
// layers).
//
// Rows 0 or 1: the segment is contiguous on both sides (Len bytes at Dev,
// Len bytes at Off), and RowLen, DevPitch and HostPitch are zero. Rows > 1:
// a strided (2-D) segment: Rows rows of RowLen bytes, row r at
// Dev + r×DevPitch on the device and at Off + r×HostPitch in the slot;
// Len = Rows × RowLen. Only layouts with LayoutSpec.Order = TokenMajor give
// 2-D segments (one per KV head: its tokens, a row each, at the stride of
// the rank's heads on the device, contiguous in the slot).
type Segment struct {
	Dev   uint64
	Off   uint64
	Len   uint64
	Layer int

	Rows      uint64
	RowLen    uint64
	DevPitch  uint64
	HostPitch uint64
}

// Layout maps block ids to their segments and knows the slot size. It is
// immutable and safe for concurrent use.
type Layout struct {
	spec     LayoutSpec
	segLen   uint64 // one layer's K (or V); for CrossLayer the whole block
	segSpan  uint64 // segLen rounded up to segmentAlign
	slotSize uint64
	perBlock int // segments per block

	heads     HeadRange // the rank's heads (normalized: never zero)
	layerLen  uint64    // one layer's K (or V) in the slot, all heads
	headBytes uint64    // one head of one layer's K: tokens × head dim × dtype
	rowLen    uint64    // one token of one head: head dim × dtype
	devSeg    uint64    // one layer's K (or V) on the device: the rank's heads
	devLen    uint64    // device bytes checked per tensor entry: devSeg, or the whole block (CrossLayer)
}

// NewLayout validates spec and returns its layout. Errors (a bad geometry,
// layout or head range) name the bad value and its limit.
func NewLayout(spec LayoutSpec) (*Layout, error) {
	segLen, err := spec.Geometry.segmentLen()
	if err != nil {
		return nil, err
	}
	if spec.NumBlocks <= 0 {
		return nil, fmt.Errorf("%w: NumBlocks = %d, must be at least 1", errLayout, spec.NumBlocks)
	}
	g := spec.Geometry
	if spec.Kind == MLA && g.KVHeads != 1 {
		return nil, fmt.Errorf("%w: KVHeads = %d, an MLA layout has one latent per layer (must be 1)", errGeometry, g.KVHeads)
	}
	if spec.Stage != (LayerRange{}) && (spec.Stage.First != 0 || spec.Stage.Count != g.Layers) {
		return nil, fmt.Errorf("%w: LayoutSpec.Stage layers [%d, %d) of %d: pipeline-parallel stages are not supported as layer ranges "+
			"(describe the stage's own layers as the geometry and name the stage in the key namespace)", errLayout, spec.Stage.First, spec.Stage.First+spec.Stage.Count, g.Layers)
	}
	if !spec.Order.valid() {
		return nil, fmt.Errorf("%w: Order = %d, want OrderUndeclared (0), TokenMajor (1) or HeadMajor (2)", errLayout, uint8(spec.Order))
	}
	if spec.Order != OrderUndeclared && g.KVHeads > maxKVHeads {
		return nil, fmt.Errorf("%w: KVHeads = %d, at most %d for a layout of declared order", errGeometry, g.KVHeads, maxKVHeads)
	}
	heads := spec.Heads
	if heads == (HeadRange{}) {
		heads = HeadRange{First: 0, Count: g.KVHeads}
	}
	if err := heads.within(g.KVHeads, "the model's"); err != nil {
		return nil, fmt.Errorf("LayoutSpec.Heads: %w", err)
	}
	if spec.Order == OrderUndeclared && heads.Count != g.KVHeads {
		return nil, fmt.Errorf("%w: LayoutSpec.Heads %v is not all %d heads; a head range needs LayoutSpec.Order (TokenMajor or HeadMajor)", errHeadRange, heads, g.KVHeads)
	}
	l := &Layout{spec: spec, segLen: segLen, layerLen: segLen, heads: heads}
	l.spec.Layers = append([]LayerTensors(nil), spec.Layers...)
	l.spec.Heads = heads
	// segLen = KVHeads × headBytes exactly (segmentLen checked the product).
	l.headBytes = segLen / uint64(g.KVHeads)
	l.rowLen = uint64(g.HeadDim) * uint64(g.DTypeBytes)
	l.devSeg = l.headBytes * uint64(heads.Count)
	l.devLen = l.devSeg
	segSpan, ok := alignUp(segLen, segmentAlign)
	if !ok {
		return nil, fmt.Errorf("%w: segment size %d overflows 64 bits when aligned", errGeometry, segLen)
	}
	l.segSpan = segSpan
	switch spec.Kind {
	case LayerSeparate, MLA:
		if len(spec.Layers) != g.Layers {
			return nil, fmt.Errorf("%w: %d layer tensors given, geometry has %d layers", errLayout, len(spec.Layers), g.Layers)
		}
		perLayer := uint64(2)
		if spec.Kind == MLA {
			perLayer = 1
		}
		hi, n := bits.Mul64(segSpan, perLayer*uint64(g.Layers))
		if hi != 0 {
			return nil, fmt.Errorf("%w: slot size %d × %d segments overflows 64 bits", errGeometry, segSpan, perLayer*uint64(g.Layers))
		}
		l.slotSize = n
		l.perBlock = int(perLayer) * g.Layers * l.segmentsPerKV(heads.Count)
		for i, lt := range spec.Layers {
			if err := l.checkLayer(i, lt); err != nil {
				return nil, err
			}
		}
	case CrossLayer:
		perLayer := uint64(2)
		hi, n := bits.Mul64(segLen, perLayer*uint64(g.Layers))
		if hi != 0 {
			return nil, fmt.Errorf("%w: block size %d × %d overflows 64 bits", errGeometry, segLen, perLayer*uint64(g.Layers))
		}
		if len(spec.Layers) != 0 {
			return nil, fmt.Errorf("%w: cross-layer layout takes Base and Stride, not %d layer tensors", errLayout, len(spec.Layers))
		}
		l.segLen = n
		l.slotSize = n
		l.perBlock = 1
		// The device block holds the rank's heads of every layer: no
		// larger than n, so no overflow.
		l.devLen = l.devSeg * perLayer * uint64(g.Layers)
		if spec.Order != OrderUndeclared {
			l.perBlock = 2 * g.Layers * l.segmentsPerKV(heads.Count)
		}
		if err := l.checkTensor("block", spec.Base, spec.Stride, l.devLen); err != nil {
			return nil, err
		}
	default:
		return nil, fmt.Errorf("%w: unknown kind %d", errLayout, uint8(spec.Kind))
	}
	return l, nil
}

func (l *Layout) checkLayer(i int, lt LayerTensors) error {
	name := fmt.Sprintf("layer %d K", i)
	seg := l.devLen
	if err := l.checkTensor(name, lt.K, lt.Stride, seg); err != nil {
		return err
	}
	if l.spec.Kind == MLA {
		if lt.V != 0 {
			return fmt.Errorf("%w: layer %d V = %#x, an MLA layout has no V tensor (must be 0)", errLayout, i, lt.V)
		}
		return nil
	}
	if err := l.checkTensor(fmt.Sprintf("layer %d V", i), lt.V, lt.Stride, seg); err != nil {
		return err
	}
	// K and V of the layer must not overlap: either their spans are
	// disjoint, or they interleave with the same stride and at least a
	// segment between them.
	span := (uint64(l.spec.NumBlocks)-1)*lt.Stride + seg
	lo, hi := lt.K, lt.V
	if lo > hi {
		lo, hi = hi, lo
	}
	d := hi - lo
	if d >= span {
		return nil
	}
	r := d % lt.Stride
	if r >= seg && lt.Stride-r >= seg {
		return nil
	}
	return fmt.Errorf("%w: layer %d K %#x and V %#x overlap (distance %d, stride %d, segment %d)", errLayout, i, lt.K, lt.V, d, lt.Stride, seg)
}

// checkTensor checks that a tensor of NumBlocks blocks of segLen bytes every
// stride bytes from base fits in 64-bit addresses.
func (l *Layout) checkTensor(name string, base, stride, segLen uint64) error {
	if stride < segLen {
		return fmt.Errorf("%w: %s stride %d is smaller than the segment (%d bytes)", errLayout, name, stride, segLen)
	}
	hi, off := bits.Mul64(uint64(l.spec.NumBlocks-1), stride)
	if hi != 0 {
		return fmt.Errorf("%w: %s: %d blocks × stride %d overflows 64 bits", errLayout, name, l.spec.NumBlocks, stride)
	}
	end, c := bits.Add64(off, segLen, 0)
	if c == 0 {
		_, c = bits.Add64(base, end, 0)
	}
	if c != 0 {
		return fmt.Errorf("%w: %s at %#x + %d bytes overflows 64-bit addresses", errLayout, name, base, end)
	}
	return nil
}

// Kind returns the layout's kind.
func (l *Layout) Kind() LayoutKind { return l.spec.Kind }

// Geometry returns the layout's geometry.
func (l *Layout) Geometry() Geometry { return l.spec.Geometry }

// numBlocks returns the number of blocks of the GPU cache.
func (l *Layout) numBlocks() int { return l.spec.NumBlocks }

// SlotSize returns the bytes of host storage one block needs: the sum of its
// segments, each starting at a multiple of 16 bytes (the copy kernel's
// vector width).
func (l *Layout) SlotSize() uint64 { return l.slotSize }

// segmentsPerBlock returns how many segments Segments gives for every
// block: 2 × Layers (layer-separate), Layers (MLA) or 1 (cross-layer) for a
// layout of undeclared order; with an order, one per layer and K/V (2-D
// TokenMajor segments: one per head of the rank, unless they are
// contiguous, see Segments).
func (l *Layout) segmentsPerBlock() int { return l.perBlock }

// CheckBlock returns an error ("block id out of range") if id is not a block
// id of the layout.
func (l *Layout) CheckBlock(id int) error {
	if id < 0 || id >= l.spec.NumBlocks {
		return fmt.Errorf("%w: block id %d, layout has %d blocks", errBlockID, id, l.spec.NumBlocks)
	}
	return nil
}

// Segments appends the segments of block id to dst and returns it: the
// rank's heads (LayoutSpec.Heads), what a store copies and a load fills. In
// the slot, blocks are stored layer by layer, K then V; segments come in
// that order, ascending by Off. dst is unchanged on error (a block id out
// of range).
func (l *Layout) Segments(id int, dst []Segment) ([]Segment, error) {
	if err := l.CheckBlock(id); err != nil {
		return dst, err
	}
	if l.spec.Order != OrderUndeclared {
		return l.segmentsRange(id, l.heads, dst), nil
	}
	if l.spec.Kind == CrossLayer {
		return l.layerSegments(uint64(id), 0, dst), nil
	}
	for i := range l.spec.Layers {
		dst = l.layerSegments(uint64(id), i, dst)
	}
	return dst, nil
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

// denseTensors places spec's tensors back to back from base, seg bytes a
// block per layer tensor (DenseRankSpec, and denseSpec in tests).
func denseTensors(spec LayoutSpec, seg, base uint64) LayoutSpec {
	g, n := spec.Geometry, uint64(spec.NumBlocks)
	switch spec.Kind {
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
// Segments whose Layer is layer, computed directly (for a layout of
// declared order: the rank's heads, as Segments). A cross-layer block of
// undeclared order has no per-layer segments: every layer gives its one
// segment at layer 0 and none at others. dst is unchanged on error.
func (l *Layout) LayerSegments(id, layer int, dst []Segment) ([]Segment, error) {
	if err := l.CheckBlock(id); err != nil {
		return dst, err
	}
	if layer < 0 || layer >= l.spec.Geometry.Layers {
		return dst, fmt.Errorf("%w: layer %d, the geometry has %d layers", errLayout, layer, l.spec.Geometry.Layers)
	}
	b := uint64(id)
	if l.spec.Order != OrderUndeclared {
		return l.layerSegmentsRange(b, layer, l.heads, dst), nil
	}
	if l.spec.Kind == CrossLayer && layer != 0 {
		return dst, nil
	}
	return l.layerSegments(b, layer, dst), nil
}

// layerSegments appends block b's segments of layer (a layout of undeclared
// order; the whole block for CrossLayer), unchecked: Segments and
// LayerSegments check b and layer.
func (l *Layout) layerSegments(b uint64, layer int, dst []Segment) []Segment {
	switch l.spec.Kind {
	case CrossLayer:
		return append(dst, Segment{Dev: l.spec.Base + b*l.spec.Stride, Off: 0, Len: l.segLen, Layer: -1})
	case MLA:
		lt := l.spec.Layers[layer]
		return append(dst, Segment{Dev: lt.K + b*lt.Stride, Off: uint64(layer) * l.segSpan, Len: l.segLen, Layer: layer})
	default:
		// K and V written in place (two Segments built by value and
		// appended stalled on store forwarding).
		lt := &l.spec.Layers[layer]
		off := uint64(2*layer) * l.segSpan
		n := len(dst)
		dst = slices.Grow(dst, 2)[:n+2]
		k, v := &dst[n], &dst[n+1]
		*k, *v = Segment{}, Segment{}
		k.Dev, k.Off, k.Len, k.Layer = lt.K+b*lt.Stride, off, l.segLen, layer
		v.Dev, v.Off, v.Len, v.Layer = lt.V+b*lt.Stride, off+l.segSpan, l.segLen, layer
		return dst
	}
}
