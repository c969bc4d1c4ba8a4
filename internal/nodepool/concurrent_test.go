package nodepool

import (
	"sync"
	"testing"
	"time"
)

// TestConcurrentCallers: many goroutines share one client (callers lead
// the connection in turn, handing each other's replies over) while
// another client stores; every reply reaches its caller, no lease or
// reservation is left behind, and the idle reader still sees pushes
// afterwards.
func TestConcurrentCallers(t *testing.T) {
	s := startServer(t, ServerConfig{PoolBytes: 8 << 20, RegionBytes: 2 << 20})
	c := dial(t, s.Addr(), ClientConfig{})
	defer c.Close()
	w := dial(t, s.Addr(), ClientConfig{})
	defer w.Close()
	c.WaitRegions(10 * time.Second)
	w.WaitRegions(10 * time.Second)
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			keys := testKeys(100+g, 8)
			for i := 0; i < 100; i++ {
				cl := c
				if g%4 == 0 {
					cl = w
				}
				res, err := cl.BeginStore(StoreRequest{Keys: keys}, nil)
				if err != nil {
					errs <- err
					return
				}
				var slots []Slot
				for _, r := range res {
					if r.Outcome == StoreWrite {
						fill(cl.SlotBytes(r.Slot), keys[0])
						slots = append(slots, r.Slot)
					}
				}
				if err := cl.CommitStore(slots); err != nil {
					errs <- err
					return
				}
				_, leased, err := cl.Lookup(keys, true, nil)
				if err != nil {
					errs <- err
					return
				}
				if err := cl.Unlease(leased); err != nil {
					errs <- err
					return
				}
				if _, err := cl.Delete(keys[:2]); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	st := waitStats(t, s, "nothing held", func(st Stats) bool { return st.Cache.Leased == 0 && st.Cache.Writing == 0 })
	if st.Cache.LookupKeys != 8*100*8 {
		t.Fatalf("lookups %d", st.Cache.LookupKeys)
	}
	// Idle: a trim's retirement reaches both clients through their idle
	// readers.
	if _, err := w.Trim(2 << 20); err != nil {
		t.Fatal(err)
	}
	waitStats(t, s, "region freed", func(st Stats) bool { return st.FreedBytes == 2<<20 })
}

// TestLargeOps: the largest messages (MaxKeys keys with their parents,
// MaxKeys slots back) pass through the socket, and longer ops are split.
func TestLargeOps(t *testing.T) {
	n := 5000 // more than wire.MaxKeys
	s := startServer(t, ServerConfig{ClientShare: 1, PoolBytes: int64(n+100) * testSlot, NoPrefault: true})
	c := dial(t, s.Addr(), ClientConfig{NoPrefault: true})
	defer c.Close()
	keys := testKeys(20, n)
	parents := make([]Key, n)
	for i := 1; i < n; i++ {
		parents[i] = keys[i-1]
	}
	res, err := c.BeginStore(StoreRequest{Keys: keys, Parents: parents}, nil)
	if err != nil {
		t.Fatal(err)
	}
	slots := make([]Slot, 0, n)
	for i, r := range res {
		if r.Outcome != StoreWrite {
			t.Fatalf("key %d: %d", i, r.Outcome)
		}
		slots = append(slots, r.Slot)
	}
	if err := c.CommitStore(slots); err != nil {
		t.Fatal(err)
	}
	hits, leased, err := c.Lookup(keys, true, nil)
	if err != nil || hits != n || len(leased) != n {
		t.Fatalf("%d hits, %d leased, %v", hits, len(leased), err)
	}
	if err := c.Unlease(leased); err != nil {
		t.Fatal(err)
	}
	lr, err := c.BeginLoad(keys, nil)
	if err != nil || len(lr) != n || !lr[n-1].Found {
		t.Fatalf("load: %d %v", len(lr), err)
	}
	slots = slots[:0]
	for _, r := range lr {
		slots = append(slots, r.Slot)
	}
	if err := c.EndLoad(slots); err != nil {
		t.Fatal(err)
	}
	if d, err := c.Delete(keys); err != nil || d != n {
		t.Fatalf("delete %d %v", d, err)
	}
	if st := s.Stats(); st.Cache.Leased != 0 || st.Cache.Ready != 0 {
		t.Fatalf("stats %+v", st.Cache)
	}
}
