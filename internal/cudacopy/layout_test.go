package cudacopy

import (
	"fmt"
	"math/rand/v2"
)

// layout describes a round-trip test pattern: blocks of KV at random slots on
// both sides. Cross-layer blocks are one segment each; layer-separate blocks
// have 2*layers segments, one per (layer, K/V) tensor on the device, all
// contiguous in the block's host slot.
type layout struct {
	name   string
	blocks int
	tensor int // segments per block: 1 (cross-layer) or 2*layers
	seg    uint64
}

func (l layout) String() string {
	return fmt.Sprintf("%s/%d-blocks/%s", l.name, l.blocks, FormatBytes(l.seg))
}

// bytes is the size of either side.
func (l layout) bytes() uint64 { return uint64(l.blocks*l.tensor) * l.seg }

func crossLayer(blocks int, seg uint64) layout {
	return layout{name: "cross-layer", blocks: blocks, tensor: 1, seg: seg}
}

func layerSeparate(blocks, layers int, seg uint64) layout {
	return layout{name: "layer-separate", blocks: blocks, tensor: 2 * layers, seg: seg}
}

// segments returns the H2D segments (host → device) of every block, block b
// living in host slot ph[b] and device block pd[b]; the D2H segments are the
// same with source and destination swapped onto host2.
func (l layout) segments(host, dev, host2 uint64, rng *rand.Rand) (h2d, d2h []Segment) {
	ph, pd := rng.Perm(l.blocks), rng.Perm(l.blocks)
	slot := uint64(l.tensor) * l.seg
	for b := range l.blocks {
		for k := range l.tensor {
			h := uint64(ph[b])*slot + uint64(k)*l.seg
			d := (uint64(k)*uint64(l.blocks) + uint64(pd[b])) * l.seg
			h2d = append(h2d, Segment{Dst: dev + d, Src: host + h, Len: l.seg})
			d2h = append(d2h, Segment{Dst: host2 + h, Src: dev + d, Len: l.seg})
		}
	}
	return h2d, d2h
}
