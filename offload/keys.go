package offload

import (
	"fmt"

	"github.com/kvoffload/kvoffload/kvcache"
)

// Key is a block's 128-bit content key, chained over a sequence's blocks
// (kvcache.BlockKey; Python computes the same).
type Key = kvcache.Key

// ChainKeys returns the keys of the full blocks of tokens in namespace,
// chained from parent (zero: a sequence's start).
func ChainKeys(namespace string, parent Key, tokens []uint32, tokensPerBlock int) ([]Key, error) {
	keys, err := kvcache.ChainKeys([]byte(namespace), parent, tokens, tokensPerBlock)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidArgument, err)
	}
	return keys, nil
}

// Keys is ChainKeys in the engine's namespace from a sequence's start.
func (e *Engine) Keys(tokens []uint32) []Key {
	keys, _ := kvcache.ChainKeys([]byte(e.cfg.Namespace), Key{}, tokens, e.cfg.Layout.TokensPerBlock)
	return keys
}
