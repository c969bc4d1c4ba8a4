package kvcache

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
)

func isAny(err error, targets ...error) bool {
	for _, t := range targets {
		if errors.Is(err, t) {
			return true
		}
	}
	return false
}

type keyVectors struct {
	Cases []struct {
		Name           string   `json:"name"`
		NamespaceHex   string   `json:"namespace_hex"`
		ParentHex      string   `json:"parent_hex"`
		Tokens         []uint32 `json:"tokens"`
		TokensPerBlock int      `json:"tokens_per_block"`
		KeysHex        []string `json:"keys_hex"`
	} `json:"cases"`
}

// The vectors were generated with Python's hashlib, independently of this
// package; other languages check themselves against the same file.
func TestKeyVectors(t *testing.T) {
	b, err := os.ReadFile("testdata/key_vectors.json")
	require.NoError(t, err)
	var v keyVectors
	require.NoError(t, json.Unmarshal(b, &v))
	require.NotEmpty(t, v.Cases)
	for _, c := range v.Cases {
		t.Run(c.Name, func(t *testing.T) {
			ns, err := hex.DecodeString(c.NamespaceHex)
			require.NoError(t, err)
			pb, err := hex.DecodeString(c.ParentHex)
			require.NoError(t, err)
			var parent Key
			require.Equal(t, 16, copy(parent[:], pb))
			keys, err := ChainKeys(ns, parent, c.Tokens, c.TokensPerBlock)
			require.NoError(t, err)
			got := make([]string, len(keys))
			for i, k := range keys {
				got[i] = k.String()
			}
			if len(c.KeysHex) == 0 {
				require.Empty(t, got)
			} else {
				require.Equal(t, c.KeysHex, got)
			}
		})
	}
}

func TestChainKeysErrors(t *testing.T) {
	for _, tpb := range []int{0, -3} {
		keys, err := ChainKeys(nil, Key{}, []uint32{1, 2}, tpb)
		require.ErrorIs(t, err, errTokensPerBlock)
		require.Nil(t, keys)
	}
}

func FuzzChainKeys(f *testing.F) {
	f.Add([]byte("ns"), []byte{1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0}, 2, byte(0))
	f.Add([]byte{}, []byte{}, 1, byte(7))
	f.Add([]byte{0}, make([]byte, 4*33), 16, byte(1))
	f.Fuzz(func(t *testing.T, ns, raw []byte, tpb int, p byte) {
		tokens := make([]uint32, len(raw)/4)
		for i := range tokens {
			tokens[i] = uint32(raw[4*i]) | uint32(raw[4*i+1])<<8 | uint32(raw[4*i+2])<<16 | uint32(raw[4*i+3])<<24
		}
		parent := Key{p}
		keys, err := ChainKeys(ns, parent, tokens, tpb)
		if tpb < 1 {
			require.ErrorIs(t, err, errTokensPerBlock)
			return
		}
		require.NoError(t, err)
		require.Len(t, keys, len(tokens)/tpb)
		// Chaining: each key is blockKey over its parent; a prefix of the
		// tokens gives a prefix of the keys.
		prev := parent
		for i, k := range keys {
			require.Equal(t, blockKey(ns, prev, tokens[i*tpb:(i+1)*tpb]), k)
			prev = k
		}
		if len(keys) > 1 {
			half, err := ChainKeys(ns, parent, tokens[:tpb], tpb)
			require.NoError(t, err)
			require.Equal(t, keys[:1], half)
		}
	})
}
