package main

import (
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"
)

func TestRegistry(t *testing.T) {
	r := newRegistry[string](kindOp, "op")
	h := r.add("a")
	require.Equal(t, kindOp, h>>kindShift)
	v, err := r.get(h)
	require.NoError(t, err)
	require.Equal(t, "a", v)

	for _, bad := range []uint64{0, 1, h + 1, kindLease<<kindShift | 1, ^uint64(0)} {
		_, err := r.get(bad)
		require.ErrorIs(t, err, errUnknown, "handle %#x", bad)
	}
	v, err = r.take(h)
	require.NoError(t, err)
	require.Equal(t, "a", v)
	_, err = r.take(h)
	require.ErrorIs(t, err, errStale)
	_, err = r.get(h)
	require.ErrorIs(t, err, errStale)
	require.Zero(t, r.len())

	r.restore(h, "b")
	v, err = r.get(h)
	require.NoError(t, err)
	require.Equal(t, "b", v)
}

// Concurrent takes of one handle: exactly one wins.
func TestRegistryTakeOnce(t *testing.T) {
	r := newRegistry[int](kindLease, "lease")
	h := r.add(7)
	var wg sync.WaitGroup
	wins := make(chan int, 8)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := r.take(h); err == nil {
				wins <- 1
			} else if !errors.Is(err, errStale) {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	close(wins)
	require.Len(t, wins, 1)
}

// Property: a registry behaves like a map whose keys are never reused;
// absent handles are stale exactly when they were issued before.
func TestRegistryModel(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		r := newRegistry[int](kindEngine, "engine")
		live := map[uint64]int{}
		var issued []uint64
		t.Repeat(map[string]func(*rapid.T){
			"add": func(t *rapid.T) {
				v := rapid.Int().Draw(t, "v")
				h := r.add(v)
				require.NotContains(t, issued, h)
				issued = append(issued, h)
				live[h] = v
			},
			"take": func(t *rapid.T) {
				if len(issued) == 0 {
					t.Skip()
				}
				h := rapid.SampledFrom(issued).Draw(t, "h")
				v, err := r.take(h)
				if want, ok := live[h]; ok {
					require.NoError(t, err)
					require.Equal(t, want, v)
					delete(live, h)
				} else {
					require.ErrorIs(t, err, errStale)
				}
			},
			"": func(t *rapid.T) {
				require.Equal(t, len(live), r.len())
			},
		})
	})
}
