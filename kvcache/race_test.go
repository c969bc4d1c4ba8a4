package kvcache

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// Many goroutines storing, loading, looking up, deleting and trimming at
// once, with TinyLFU's goroutine feeding advice, with and without OnFree
// zeroing released slots off the lock: run under -race.
func TestConcurrent(t *testing.T) {
	for _, zero := range []bool{false, true} {
		t.Run(fmt.Sprint("onFree=", zero), func(t *testing.T) { testConcurrent(t, zero) })
	}
}

func testConcurrent(t *testing.T, zero bool) {
	p, err := NewTinyLFU(TinyLFUConfig{MaxBlocks: 256})
	require.NoError(t, err)
	var zeroed atomic.Int64
	cfg := Config{Policy: p, LowWatermark: 16, Layout: tinyLayout(t, 4096)}
	if zero {
		cfg.OnFree = func(Slot) { zeroed.Add(1) }
	}
	c := newCache(t, 256, cfg)
	const workers, rounds = 8, 150
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for r := 0; r < rounds; r++ {
				ks, ids := keysN((w*rounds+r)%97*8, 8)
				c.Lookup(ks)
				res, err := c.BeginStore(StoreRequest{Keys: ks, BlockIDs: ids}, nil)
				if !assertNoErr(t, err) {
					return
				}
				var slots []Slot
				for _, x := range res {
					if x.Outcome == StoreWrite {
						slots = append(slots, x.Slot)
					}
				}
				if !assertNoErr(t, c.CompleteStore(slots, nil)) {
					return
				}
				n, leases := c.LookupLease(ks, nil)
				lr, err := c.BeginLoad(ks[:n], ids[:n], nil)
				if !assertNoErr(t, err) {
					return
				}
				var found []Slot
				for _, x := range lr {
					if x.Found {
						found = append(found, x.Slot)
					}
				}
				if !assertNoErr(t, c.EndLoad(found)) || !assertNoErr(t, c.Unlease(leases)) {
					return
				}
				if r%50 == 49 {
					c.Delete(ks[4:])
				}
			}
		}(w)
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; i < 20; i++ {
			id := RegionID(100 + i)
			_, err := c.AddRegion(Region{ID: id, Base: uintptr(1+i) << 24, Size: 16 * 256})
			if !assertNoErr(t, err) {
				return
			}
			_, err = c.RemoveRegion(id)
			if !assertNoErr(t, err) {
				return
			}
			c.TakeReleasable(nil)
			_ = c.Stats()
		}
	}()
	wg.Wait()
	c.syncPolicy()
	require.NoError(t, c.Verify())
	st := c.Stats()
	require.Zero(t, st.Leased)
	require.Zero(t, st.Writing)
	require.Equal(t, st.StoreKeys, uint64(workers*rounds*8))
	require.Zero(t, st.Zeroing)
	require.Equal(t, zero, zeroed.Load() > 0)
}

func assertNoErr(t *testing.T, err error) bool {
	t.Helper()
	if err != nil {
		t.Error(err)
		return false
	}
	return true
}
