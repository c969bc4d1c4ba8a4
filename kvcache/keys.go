package kvcache

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
)

// Key is a block's 128-bit content key (see ChainKeys).
type Key [16]byte

// String returns the key as 32 lower-case hex digits.
func (k Key) String() string { return hex.EncodeToString(k[:]) }

// errTokensPerBlock: tokensPerBlock given to ChainKeys is below 1.
var errTokensPerBlock = errors.New("kvcache: tokens per block must be at least 1")

// blockKey returns the key of one block: the first 16 bytes of
//
//	SHA-256( parent[0:16] || le32(tokens[0]) || ... || le32(tokens[n-1]) || namespace )
//
// where parent is the previous block's key (16 zero bytes, the zero Key, for
// the first block of a sequence), le32 is a token id as 4 little-endian bytes,
// and namespace is the engine's namespace bytes (model, dtype, tokens per
// block, layout kind; may be empty), appended as is with no length prefix.
// It names neither the tensor-parallel rank nor the TP size: the ranks of
// every TP size share a block's key (see the package documentation's
// "Tensor-parallel sharing").
// Python computes the same with
//
//	hashlib.sha256(parent + struct.pack("<%dI" % len(tokens), *tokens) + namespace).digest()[:16]
func blockKey(namespace []byte, parent Key, tokens []uint32) Key {
	h := sha256.New()
	h.Write(parent[:])
	var buf [4 * 64]byte
	for len(tokens) > 0 {
		n := min(len(tokens), len(buf)/4)
		for i, t := range tokens[:n] {
			binary.LittleEndian.PutUint32(buf[4*i:], t)
		}
		h.Write(buf[:4*n])
		tokens = tokens[n:]
	}
	h.Write(namespace)
	var sum [sha256.Size]byte
	var k Key
	copy(k[:], h.Sum(sum[:0]))
	return k
}

// ChainKeys returns the keys of the full blocks of tokens, each chained to the
// one before it: key i = blockKey(namespace, key i-1, tokens[i×tpb : (i+1)×tpb]),
// with key -1 = parent (the zero Key when tokens start a sequence). A partial
// trailing block (fewer than tokensPerBlock tokens) gets no key.
func ChainKeys(namespace []byte, parent Key, tokens []uint32, tokensPerBlock int) ([]Key, error) {
	return appendChainKeys(nil, namespace, parent, tokens, tokensPerBlock)
}

// appendChainKeys is ChainKeys appending to dst; dst is unchanged on error.
func appendChainKeys(dst []Key, namespace []byte, parent Key, tokens []uint32, tokensPerBlock int) ([]Key, error) {
	if tokensPerBlock < 1 {
		return dst, fmt.Errorf("%w: got %d", errTokensPerBlock, tokensPerBlock)
	}
	for len(tokens) >= tokensPerBlock {
		parent = blockKey(namespace, parent, tokens[:tokensPerBlock])
		dst = append(dst, parent)
		tokens = tokens[tokensPerBlock:]
	}
	return dst, nil
}
