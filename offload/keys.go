package offload

import (
	"fmt"

	"github.com/kvoffload/kvoffload/kvcache"
)

// Key is a block's 128-bit content key, chained over a sequence's blocks.
type Key = kvcache.Key

// ChainKeys returns the keys of tokens' full blocks, chained from parent.
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
