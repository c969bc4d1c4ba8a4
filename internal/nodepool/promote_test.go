package nodepool

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvoffload/kvoffload/internal/tiered"
)

// TestNodeDiskPromoteChunks: BeginLoadTiers reports the keys the pool
// lacks and the disk holds OnDisk without reading them (the pool's found,
// the others missing, in one round trip); Promote brings them in chunk by
// chunk, byte-exact; while a chunk's read is held on the node, the same
// client's EndLoad of the chunk before and its lookups are answered (the
// promoter reads in the background) and a second Promote queued behind it
// waits for it; once the read goes on, every promoted block is found and
// the node's holds add up to nothing after the EndLoads.
func TestNodeDiskPromoteChunks(t *testing.T) {
	s := startServer(t, ServerConfig{ClientShare: 1, PoolBytes: 8 * testSlot, RegionBytes: 8 * testSlot,
		Disk: &tiered.DiskConfig{Dirs: []string{t.TempDir()}, CapacityBytes: 8 << 20, WriteThrough: true}})
	keys := testKeys(11, 24)
	held := keys[3]
	var reads atomic.Int64
	reached, gate := make(chan struct{}), make(chan struct{})
	s.mu.Lock() // openDisk reads it under s.mu
	s.beforeDiskGet = func(k Key) {
		reads.Add(1)
		if k == held {
			close(reached)
			<-gate
		}
	}
	s.mu.Unlock()
	a := dialMapped(t, s)
	for i, k := range keys {
		storeOneBlock(t, a, k, Key{})
		waitStats(t, s, "write-through", func(st Stats) bool { return st.DiskWrites == int64(i+1) })
	}
	// The pool holds 8 of them: the last ones.
	want := append(append([]Key(nil), keys[:6]...), keys[20:]...)
	want = append(want, testKeys(99, 1)...) // stored nowhere
	res, err := a.BeginLoadTiers(want, nil)
	if err != nil {
		t.Fatal(err)
	}
	var found []Slot
	for i, r := range res {
		switch {
		case i < 6:
			if r.Found || !r.OnDisk {
				t.Fatalf("key %d: %+v, want on disk", i, r)
			}
		case i < 10:
			if !r.Found || r.OnDisk {
				t.Fatalf("key %d: %+v, want found", i, r)
			}
			if err := check(a.SlotBytes(r.Slot), want[i]); err != nil {
				t.Fatal(err)
			}
			found = append(found, r.Slot)
		default:
			if r.Found || r.OnDisk {
				t.Fatalf("key %d: %+v, want missing", i, r)
			}
		}
	}
	if n := reads.Load(); n != 0 {
		t.Fatalf("BeginLoadTiers read %d records", n)
	}

	parents := func(ks []Key) []Key { return make([]Key, len(ks)) }
	first, err := a.Promote(keys[:2], parents(keys[:2]), nil)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range first {
		if !r.Found {
			t.Fatalf("chunk 1 key %d not promoted", i)
		}
		if err := check(a.SlotBytes(r.Slot), keys[i]); err != nil {
			t.Fatal(err)
		}
	}
	type reply struct {
		res []LoadResult
		err error
	}
	second, third := make(chan reply, 1), make(chan reply, 1)
	go func() {
		r, err := a.Promote(keys[2:4], parents(keys[2:4]), nil)
		second <- reply{r, err}
	}()
	<-reached
	go func() {
		r, err := a.Promote(keys[4:6], parents(keys[4:6]), nil)
		third <- reply{r, err}
	}()
	// The read of keys[3] is held: the client's other calls go on.
	if err := a.EndLoad([]Slot{first[0].Slot, first[1].Slot}); err != nil {
		t.Fatal(err)
	}
	if h, _, _, err := a.LookupTiers(keys[20:], false, nil); err != nil || h != 4 {
		t.Fatalf("a lookup while a promotion reads: %d hits, %v", h, err)
	}
	time.Sleep(20 * time.Millisecond)
	select {
	case r := <-third:
		t.Fatalf("the Promote queued behind the held one answered first: %+v", r)
	default:
	}
	if n := reads.Load(); n != 4 {
		t.Fatalf("%d reads while the second chunk's last is held, want 4 (the third chunk's wait)", n)
	}
	close(gate)
	for i, ch := range []chan reply{second, third} {
		r := <-ch
		if r.err != nil {
			t.Fatal(r.err)
		}
		for j, x := range r.res {
			k := keys[2+2*i+j]
			if !x.Found {
				t.Fatalf("chunk %d key %d not promoted", i+2, j)
			}
			if err := check(a.SlotBytes(x.Slot), k); err != nil {
				t.Fatal(err)
			}
			found = append(found, x.Slot)
		}
	}
	if err := a.EndLoad(found); err != nil {
		t.Fatal(err)
	}
	st := s.Stats()
	if st.DiskHits != 6 || st.DiskMisses != 0 {
		t.Fatalf("promotions: %d hits, %d misses", st.DiskHits, st.DiskMisses)
	}
	if st.Cache.Leased != 0 || st.Cache.Writing != 0 || st.Cache.StoresInFlight != 0 {
		t.Fatalf("holds left after the EndLoads: %+v", st.Cache)
	}
	// Without FlagDiskLater, BeginLoad still promotes before it answers.
	loadChecked(t, a, keys[6:8])
}

// TestNodeDiskPromoteBye: a client that says goodbye with a Promote's
// read held on the node is released once the read ends: the promoted
// block's load is given back, nothing stays reserved or leased.
func TestNodeDiskPromoteBye(t *testing.T) {
	s := startServer(t, ServerConfig{ClientShare: 1, PoolBytes: 8 * testSlot, RegionBytes: 8 * testSlot,
		Disk: &tiered.DiskConfig{Dirs: []string{t.TempDir()}, CapacityBytes: 8 << 20, WriteThrough: true}})
	keys := testKeys(12, 12)
	reached, gate := make(chan struct{}), make(chan struct{})
	var once atomic.Bool
	s.mu.Lock()
	s.beforeDiskGet = func(Key) {
		if once.CompareAndSwap(false, true) {
			close(reached)
			<-gate
		}
	}
	s.mu.Unlock()
	a := dial(t, s.Addr(), ClientConfig{})
	if !a.WaitRegions(10 * time.Second) {
		t.Fatal("regions not mapped")
	}
	for i, k := range keys {
		storeOneBlock(t, a, k, Key{})
		waitStats(t, s, "write-through", func(st Stats) bool { return st.DiskWrites == int64(i+1) })
	}
	done := make(chan error, 1)
	go func() {
		_, err := a.Promote(keys[:2], make([]Key, 2), nil)
		done <- err
	}()
	<-reached
	if st := s.Stats(); st.Cache.StoresInFlight != 2 {
		t.Fatalf("%d promotions reserved while the read is held, want 2", st.Cache.StoresInFlight)
	}
	closed := make(chan struct{})
	go func() {
		a.Close()
		close(closed)
	}()
	time.Sleep(20 * time.Millisecond)
	close(gate)
	<-closed
	<-done // answered, or failed with the connection: either way released
	waitStats(t, s, "the client released", func(st Stats) bool {
		return st.Clients == 0 && st.Cache.Leased == 0 && st.Cache.StoresInFlight == 0 && st.Cache.Writing == 0
	})
}
