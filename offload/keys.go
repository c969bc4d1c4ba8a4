package offload

import (
	"fmt"

	"github.com/kvoffload/kvoffload/kvcache"
)

// Key is a block's 128-bit content key: SHA-256, truncated, over the parent
// block's key, the block's token ids (little-endian uint32) and the
// namespace. Python computes the same keys with hashlib (see kvcache.BlockKey).
type Key = kvcache.Key

// ChainKeys returns the keys of the full blocks of tokens in namespace,
// chained from parent (the zero Key when tokens start a sequence). A partial
// trailing block gets no key.
func ChainKeys(namespace string, parent Key, tokens []uint32, tokensPerBlock int) ([]Key, error) {
	keys, err := kvcache.ChainKeys([]byte(namespace), parent, tokens, tokensPerBlock)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidArgument, err)
	}
	return keys, nil
}

// Keys returns the keys of the full blocks of a sequence's tokens, in the
// engine's namespace and with its tokens per block.
func (e *Engine) Keys(tokens []uint32) []Key {
	keys, _ := kvcache.ChainKeys([]byte(e.cfg.Namespace), Key{}, tokens, e.cfg.Layout.TokensPerBlock)
	return keys
}
