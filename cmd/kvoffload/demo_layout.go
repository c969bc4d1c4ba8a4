package main

import (
	"encoding/binary"
	"fmt"
	"sort"
	"strings"

	"github.com/kvoffload/kvoffload/offload"
)

// modelShape is the KV geometry of one model (per tensor-parallel rank).
type modelShape struct {
	Layers, KVHeads, HeadDim, DTypeBytes, TokensPerBlock int
	About                                                string
}

// layoutPresets are the --layout choices.
var layoutPresets = map[string]modelShape{
	"tiny": {Layers: 2, KVHeads: 2, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16, About: "2 layers, 2 KV heads of 64, bf16: 16 KiB blocks of 4 KiB segments"},
	"8b":   {Layers: 32, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, TokensPerBlock: 16, About: "Llama-3-8B: 32 layers, 8 KV heads of 128, bf16: 2 MiB blocks of 32 KiB segments"},
	"70b":  {Layers: 80, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, TokensPerBlock: 16, About: "Llama-3-70B: 80 layers, 8 KV heads of 128, bf16: 5 MiB blocks of 32 KiB segments"},
}

func presetNames() string {
	names := make([]string, 0, len(layoutPresets))
	for n := range layoutPresets {
		names = append(names, n)
	}
	sort.Strings(names)
	return strings.Join(names, "|")
}

// cacheLayout is the demo's GPU KV cache: a shape, a kind and a number of
// blocks, placed at base in one allocation of Bytes() bytes. Segment order
// within a block: K then V of layer 0, K then V of layer 1, ... (one
// segment for the cross-layer kind).
type cacheLayout struct {
	shape  modelShape
	kind   offload.LayoutKind
	blocks int
	base   uint64
}

// segBytes is the size of one K or V segment of one layer.
func (l cacheLayout) segBytes() int64 {
	s := l.shape
	return int64(s.TokensPerBlock) * int64(s.KVHeads) * int64(s.HeadDim) * int64(s.DTypeBytes)
}

// blockBytes is the size of one block (all layers, K and V).
func (l cacheLayout) blockBytes() int64 { return 2 * int64(l.shape.Layers) * l.segBytes() }

// segments is the number of segments of one block.
func (l cacheLayout) segments() int {
	if l.kind == offload.LayoutCrossLayer {
		return 1
	}
	return 2 * l.shape.Layers
}

// Bytes is the size of the whole cache.
func (l cacheLayout) Bytes() int64 { return int64(l.blocks) * l.blockBytes() }

// segment returns the address and length of segment i of block b. For the
// layer-separate kind, tensor t (K of layer t/2 or its V) holds every
// block's segment t at base + t×blocks×seg + b×seg.
func (l cacheLayout) segment(b, i int) (addr, n uint64) {
	if l.kind == offload.LayoutCrossLayer {
		bb := uint64(l.blockBytes())
		return l.base + uint64(b)*bb, bb
	}
	seg := uint64(l.segBytes())
	return l.base + uint64(i)*uint64(l.blocks)*seg + uint64(b)*seg, seg
}

// spec is the offload.LayoutSpec describing the cache to the engine.
func (l cacheLayout) spec() offload.LayoutSpec {
	s := l.shape
	ls := offload.LayoutSpec{Kind: l.kind, Layers: s.Layers, KVHeads: s.KVHeads, HeadDim: s.HeadDim,
		DTypeBytes: s.DTypeBytes, TokensPerBlock: s.TokensPerBlock, NumBlocks: l.blocks}
	if l.kind == offload.LayoutCrossLayer {
		ls.Base, ls.Stride = l.base, uint64(l.blockBytes())
		return ls
	}
	seg := uint64(l.segBytes())
	for layer := range s.Layers {
		k, _ := l.segment(0, 2*layer)
		v, _ := l.segment(0, 2*layer+1)
		ls.LayerTensors = append(ls.LayerTensors, offload.LayerTensors{K: k, V: v, Stride: seg})
	}
	return ls
}

// segmentSeed is the fill seed of segment i of the block with key k: the
// block's content is a pure function of its key. Word w of the segment is
// mix64(seed+w) (cudacopy.FillPattern); segments hold at most 2^37 words,
// so the seeds of one key's segments, 2^40 apart, never share a word value.
func segmentSeed(k offload.Key, i int) uint64 {
	return (binary.LittleEndian.Uint64(k[:8]) ^ binary.LittleEndian.Uint64(k[8:])) + uint64(i)<<40
}

// checkLayout validates the demo cache's parameters.
func checkLayout(l cacheLayout) error {
	if l.blocks < 1 {
		return fmt.Errorf("%w: --gpu-blocks %d must be at least 1", errUsage, l.blocks)
	}
	switch l.kind {
	case offload.LayoutLayerSeparate, offload.LayoutCrossLayer:
	default:
		return fmt.Errorf("%w: --layout-kind %q must be %q or %q", errUsage, l.kind, offload.LayoutLayerSeparate, offload.LayoutCrossLayer)
	}
	// The product is checked by division first: blocks × block bytes must
	// not wrap (--gpu-blocks 9223372036854775807 is a usage error naming
	// the limit, not a negative size).
	if bb := l.blockBytes(); int64(l.blocks) > maxSize/bb {
		return fmt.Errorf("%w: --gpu-blocks %d: %d GPU blocks of %s are above the limit of %s (at most %d such blocks)",
			errUsage, l.blocks, l.blocks, formatSize(bb), formatSize(maxSize), maxSize/bb)
	}
	return nil
}
