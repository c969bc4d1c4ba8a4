package kvcache

import (
	"testing"

	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"
)

// TestKeyIndexMatchesMap runs random puts and deletes against keyIndex and a
// map; keys come from a small set that collides in the table's buckets.
func TestKeyIndexMatchesMap(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		var x keyIndex
		m := map[Key]int32{}
		for _, op := range rapid.SliceOf(rapid.IntRange(0, 3*200-1)).Draw(t, "ops") {
			k := key(op % 200)
			switch op / 200 {
			case 0, 1:
				x.put(k, int32(op))
				m[k] = int32(op)
			default:
				x.del(k)
				delete(m, k)
			}
			require.Equal(t, len(m), x.len())
		}
		for i := 0; i < 200; i++ {
			got, ok := x.get(key(i))
			want, wok := m[key(i)]
			require.Equal(t, wok, ok, "key %d", i)
			if ok {
				require.Equal(t, want, got, "key %d", i)
			}
		}
	})
}

func TestKeyIndexEmptyAndZeroKey(t *testing.T) {
	var x keyIndex
	_, ok := x.get(Key{})
	require.False(t, ok)
	x.del(Key{})
	x.put(Key{}, 0)
	got, ok := x.get(Key{})
	require.True(t, ok)
	require.Equal(t, int32(0), got)
	x.reserve(1000)
	got, ok = x.get(Key{})
	require.True(t, ok)
	require.Equal(t, int32(0), got)
	require.Equal(t, 2048, len(x.t))
	x.del(Key{})
	require.Zero(t, x.len())
}
