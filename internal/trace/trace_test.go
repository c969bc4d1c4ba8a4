package trace

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestDeterministic(t *testing.T) {
	a, err := New(seeded(7))
	require.NoError(t, err)
	b, err := New(seeded(7))
	require.NoError(t, err)
	c, err := New(seeded(8))
	require.NoError(t, err)
	same := true
	for range 200 {
		ra, rb, rc := a.Next(), b.Next(), c.Next()
		require.Equal(t, ra, rb)
		if len(ra.Tokens) != len(rc.Tokens) {
			same = false
		}
	}
	require.False(t, same, "different seeds gave the same trace")
}

func TestTurnsExtendPrefix(t *testing.T) {
	cfg := seeded(1)
	cfg.ActiveConversations = 4
	g, err := New(cfg)
	require.NoError(t, err)
	last := map[int][]uint32{}
	kinds := map[Kind]int{}
	for range 2000 {
		r := g.Next()
		kinds[r.Kind]++
		require.NotEmpty(t, r.Tokens)
		for _, tok := range r.Tokens {
			if tok >= Default.Vocab {
				t.Fatalf("token %d ≥ vocab %d", tok, Default.Vocab)
			}
		}
		if r.Kind == Turn {
			prev, ok := last[r.Conversation]
			require.True(t, ok)
			require.Greater(t, len(r.Tokens), len(prev))
			if !slices.Equal(prev, r.Tokens[:len(prev)]) {
				t.Fatalf("turn %d of conversation %d does not extend the previous one", r.Seq, r.Conversation)
			}
		}
		if r.Kind != Document {
			last[r.Conversation] = r.Tokens
		}
	}
	require.Len(t, kinds, 3)
}

func TestBadConfig(t *testing.T) {
	bad := []func(*Config){
		func(c *Config) { c.ZipfS = 0.5 },
		func(c *Config) { c.PDocument, c.PNewConversation = 0.8, 0.5 },
		func(c *Config) { c.SystemTokens = 0 },
	}
	for _, f := range bad {
		c := Default
		f(&c)
		_, err := New(c)
		require.ErrorIs(t, err, ErrConfig)
	}
}

func seeded(seed uint64) Config {
	c := Default
	c.Seed = seed
	return c
}
