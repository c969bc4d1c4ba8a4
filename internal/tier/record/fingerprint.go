package record

import (
	"crypto/sha256"
	"encoding/binary"
)

// Geometry is what a record's payload means: the namespace and the shape and
// element type of the whole model's KV cache. Two writers whose Geometry
// differs in any field get different fingerprints, so neither ever serves
// the other's records.
type Geometry struct {
	Namespace      []byte // the engine's namespace bytes (model, adapter, cache salt...)
	KVHeads        int    // total KV heads of the model, not a tensor-parallel rank's
	Layers         int    // attention layers
	HeadDim        int    // elements per head
	DTypeBytes     int    // bytes per element
	TokensPerBlock int    // tokens per block
	LayoutKind     uint8  // the engine's layout kind (layer-separate, cross-layer, MLA)
	DType          string // element type name ("bf16", "fp16", "fp8_e4m3"...)
	// HostFormat is the payload's byte order inside the host layout
	// (a HostFormat): 0 for a byte copy of the device's segments
	// (layouts that declare no device order), 1 for head-major (the same
	// bytes for every tensor-parallel size). It is hashed only when
	// non-zero, so fingerprints written before it existed do not change.
	HostFormat uint8
}

// Fingerprint returns the 64-bit fingerprint of g: the first 8 bytes
// (little-endian) of SHA-256 over a domain tag and every field of g, each
// length-prefixed so that no two geometries encode alike. It is computed once
// per store, so its cost does not matter.
func Fingerprint(g Geometry) uint64 {
	h := sha256.New()
	var b [8]byte
	put := func(p []byte) {
		binary.LittleEndian.PutUint64(b[:], uint64(len(p)))
		h.Write(b[:])
		h.Write(p)
	}
	num := func(v int64) {
		binary.LittleEndian.PutUint64(b[:], uint64(v))
		h.Write(b[:])
	}
	put([]byte("kvoffload/record/fingerprint/v1"))
	put(g.Namespace)
	num(int64(g.KVHeads))
	num(int64(g.Layers))
	num(int64(g.HeadDim))
	num(int64(g.DTypeBytes))
	num(int64(g.TokensPerBlock))
	num(int64(g.LayoutKind))
	put([]byte(g.DType))
	if g.HostFormat != 0 {
		put([]byte("host-format"))
		num(int64(g.HostFormat))
	}
	var sum [sha256.Size]byte
	return binary.LittleEndian.Uint64(h.Sum(sum[:0]))
}
