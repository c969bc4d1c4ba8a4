package kvcache

import "fmt"

// HeadRange is a range of a model's KV heads, [First, First+Count). The
// zero value stands for every head where a field says so (LayoutSpec.Heads,
// StoreRequest.Heads).
type HeadRange struct {
	First, Count int
}

// end returns First + Count, one past the last head.
func (r HeadRange) end() int { return r.First + r.Count }

func (r HeadRange) String() string { return fmt.Sprintf("[%d, %d)", r.First, r.First+r.Count) }

// within checks that r is a non-empty range inside [0, n); what names n in
// the error ("the model's", "the layout's").
func (r HeadRange) within(n int, what string) error {
	if r.Count < 1 || r.First < 0 || r.First > n-r.Count {
		return fmt.Errorf("%w: heads [%d, %d) (first %d, count %d) outside %s %d KV heads [0, %d) or empty",
			errHeadRange, r.First, r.First+r.Count, r.First, r.Count, what, n, n)
	}
	return nil
}

// contains reports whether r holds every head of q.
func (r HeadRange) contains(q HeadRange) bool { return q.First >= r.First && q.end() <= r.end() }

// overlaps reports whether r and q share a head.
func (r HeadRange) overlaps(q HeadRange) bool { return r.First < q.end() && q.First < r.end() }

// HeadOrder says how one block's tokens and heads sit inside one layer's K
// (or V) in device memory (LayoutSpec.Order).
type HeadOrder uint8

// Head orders.
const (
	// OrderUndeclared: the device order is not given. Segments are whole
	// contiguous pieces of the device's block, and the slot holds them byte
	// for byte: the layout of the releases before head
	// ranges existed. Head ranges other than all heads are refused.
	OrderUndeclared HeadOrder = iota
	// TokenMajor: [blocks, tokens, heads, head_dim] per layer (vLLM's and
	// transformers' paged caches): one head's data in a block is tokens
	// rows of head_dim × dtype bytes, at a stride of the rank's heads ×
	// head_dim × dtype. Moved with 2-D segments.
	TokenMajor
	// HeadMajor: [blocks, heads, tokens, head_dim] per layer: a rank's
	// heads of a block are one contiguous run, as in the slot.
	HeadMajor
)

func (o HeadOrder) valid() bool { return o <= HeadMajor }

func (o HeadOrder) String() string {
	switch o {
	case OrderUndeclared:
		return "undeclared"
	case TokenMajor:
		return "token-major"
	case HeadMajor:
		return "head-major"
	}
	return fmt.Sprintf("HeadOrder(%d)", uint8(o))
}

// hostRun is the contiguous host run of a head range in one layer's K (or
// V) of a slot: Len bytes at offset Off.
type hostRun struct {
	Off, Len uint64
	Layer    int
	V        bool
}

// Heads returns the range of the model's heads the layout's device tensors
// hold (all heads when LayoutSpec.Heads was zero).
func (l *Layout) Heads() HeadRange { return l.heads }

// Order returns the layout's device order.
func (l *Layout) Order() HeadOrder { return l.spec.Order }

// RankBytes returns the bytes of one block the layout's device tensors
// hold (the rank's heads of every layer): what Segments of a block add up
// to. It is SlotSize less padding when the layout holds every head.
func (l *Layout) RankBytes() uint64 {
	n := l.devSeg * uint64(l.spec.Geometry.Layers)
	if l.spec.Kind != MLA {
		n *= 2
	}
	return n
}

// kvPerLayer is 1 for MLA (K only), 2 otherwise.
func (l *Layout) kvPerLayer() int {
	if l.spec.Kind == MLA {
		return 1
	}
	return 2
}

// segmentsPerKV is how many segments n of the rank's heads take in one
// layer's K (or V): one when they are contiguous on the device (head-major,
// one head held per rank, or one token per block), else one 2-D segment per
// head.
func (l *Layout) segmentsPerKV(n int) int {
	if l.contiguous() {
		return 1
	}
	return n
}

// contiguous reports whether any run of the rank's heads is contiguous on
// the device.
func (l *Layout) contiguous() bool {
	return l.spec.Order != TokenMajor || l.heads.Count == 1 || l.spec.Geometry.TokensPerBlock == 1
}

// hostKV returns the slot offset of layer i's K (kv 0) or V (kv 1).
func (l *Layout) hostKV(i, kv int) uint64 {
	j := uint64(i*l.kvPerLayer() + kv)
	if l.spec.Kind == CrossLayer {
		return j * l.layerLen
	}
	return j * l.segSpan
}

// devKV returns the device address of block b's layer i K (kv 0) or V (kv 1),
// the rank's first head.
func (l *Layout) devKV(b uint64, i, kv int) uint64 {
	if l.spec.Kind == CrossLayer {
		return l.spec.Base + b*l.spec.Stride + uint64(2*i+kv)*l.devSeg
	}
	lt := l.spec.Layers[i]
	if kv == 0 {
		return lt.K + b*lt.Stride
	}
	return lt.V + b*lt.Stride
}

// DevStride is the device bytes between block id's and block id+1's
// segments of layer (each segment of a block lies at its block 0 address
// plus id × the stride of its tensor): the layer's tensors' Stride, or the
// cross-layer tensor's. It panics on a layer outside the geometry.
func (l *Layout) DevStride(layer int) uint64 {
	if l.spec.Kind == CrossLayer {
		return l.spec.Stride
	}
	return l.spec.Layers[layer].Stride
}

// segmentsOfRange appends to dst the segments of heads r of block id and
// returns it: per layer, K then V, the device side of the heads (2-D
// segments for a TokenMajor layout, one per head; one contiguous segment
// otherwise) and, in Off, where they go in the slot (the run hostRuns
// gives). r must lie inside Heads(): the device holds no other heads. A
// layout of undeclared order takes only r = Heads() (every head), and gives
// Segments. dst is unchanged on error (a bad block id or head range).
func (l *Layout) segmentsOfRange(id int, r HeadRange, dst []Segment) ([]Segment, error) {
	if err := l.CheckBlock(id); err != nil {
		return dst, err
	}
	if !l.heads.contains(r) || r.Count < 1 {
		return dst, fmt.Errorf("%w: heads %v, the layout's device tensors hold %v", errHeadRange, r, l.heads)
	}
	if l.spec.Order == OrderUndeclared {
		return l.Segments(id, dst)
	}
	return l.segmentsRange(id, r, dst), nil
}

// segmentsRange is segmentsOfRange for a checked block id and head range of a
// layout of declared order.
func (l *Layout) segmentsRange(id int, r HeadRange, dst []Segment) []Segment {
	for i := 0; i < l.spec.Geometry.Layers; i++ {
		dst = l.layerSegmentsRange(uint64(id), i, r, dst)
	}
	return dst
}

// layerSegmentsRange is segmentsRange for layer i only.
func (l *Layout) layerSegmentsRange(b uint64, i int, r HeadRange, dst []Segment) []Segment {
	local := uint64(r.First - l.heads.First)
	n := uint64(r.Count)
	hostHead := uint64(r.First) * l.headBytes
	for kv := 0; kv < l.kvPerLayer(); kv++ {
		dev := l.devKV(b, i, kv)
		off := l.hostKV(i, kv) + hostHead
		switch {
		case l.spec.Order == HeadMajor:
			dst = append(dst, Segment{Dev: dev + local*l.headBytes, Off: off, Len: n * l.headBytes, Layer: i})
		case l.contiguous():
			// One head held (its tokens back to back), or one token
			// per block (the heads back to back): contiguous both sides.
			dst = append(dst, Segment{Dev: dev + local*l.rowLen, Off: off, Len: n * l.headBytes, Layer: i})
		default:
			pitch := uint64(l.heads.Count) * l.rowLen
			rows := uint64(l.spec.Geometry.TokensPerBlock)
			for h := uint64(0); h < n; h++ {
				dst = append(dst, Segment{
					Dev: dev + (local+h)*l.rowLen, Off: off + h*l.headBytes, Len: l.headBytes, Layer: i,
					Rows: rows, RowLen: l.rowLen, DevPitch: pitch, HostPitch: l.rowLen,
				})
			}
		}
	}
	return dst
}

// hostRuns appends to dst the host runs of heads r in a slot and returns
// it: per layer, K then V (K only for MLA), the contiguous bytes of those
// heads. r may be any range of the model's heads (a slot holds them all).
// For a layout of undeclared order only all heads are a valid range: its
// runs are then the slot's per-layer pieces. dst is unchanged on error
// (a bad head range).
func (l *Layout) hostRuns(r HeadRange, dst []hostRun) ([]hostRun, error) {
	g := l.spec.Geometry
	if err := r.within(g.KVHeads, "the model's"); err != nil {
		return dst, err
	}
	if l.spec.Order == OrderUndeclared && r.Count != g.KVHeads {
		return dst, fmt.Errorf("%w: heads %v of %d: a layout of undeclared order stores whole blocks only", errHeadRange, r, g.KVHeads)
	}
	for i := 0; i < g.Layers; i++ {
		for kv := 0; kv < l.kvPerLayer(); kv++ {
			dst = append(dst, hostRun{Off: l.hostKV(i, kv) + uint64(r.First)*l.headBytes, Len: uint64(r.Count) * l.headBytes, Layer: i, V: kv == 1})
		}
	}
	return dst, nil
}

// DenseRankSpec returns a spec of the given kind, order and head range
// (all of g's heads when heads is zero) whose tensors lie back to back from
// base, as an allocator that gives each tensor its own buffer would place
// them: per layer a K tensor of numBlocks blocks of the rank's heads then a
// V tensor (LayerSeparate), one latent tensor per layer (MLA), or one
// tensor of whole blocks of the rank's heads (CrossLayer). For tests, demos
// and benchmarks, and to size a device allocation; NewLayout validates the
// result (a bad range included).
func DenseRankSpec(kind LayoutKind, g Geometry, order HeadOrder, heads HeadRange, numBlocks int, base uint64) LayoutSpec {
	spec := LayoutSpec{Kind: kind, Geometry: g, NumBlocks: numBlocks, Order: order, Heads: heads}
	seg, err := g.segmentLen()
	if err != nil || numBlocks <= 0 {
		return spec
	}
	h := heads
	if h == (HeadRange{}) {
		h.Count = g.KVHeads
	}
	if h.Count < 1 || h.Count > g.KVHeads {
		return spec
	}
	return denseTensors(spec, seg/uint64(g.KVHeads)*uint64(h.Count), base)
}
