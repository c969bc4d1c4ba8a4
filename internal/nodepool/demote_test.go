package nodepool

import (
	"encoding/binary"
	"sync"
	"testing"
	"time"

	"github.com/kvoffload/kvoffload/internal/tiered"
)

// spreadKeys returns n keys whose every byte is hashed (as real keys are),
// so that the admission sketch counts each on its own.
func spreadKeys(seed, n int) []Key {
	keys := make([]Key, n)
	x := uint64(seed)<<32 + 0x9e3779b97f4a7c15
	next := func() uint64 { // splitmix64
		x += 0x9e3779b97f4a7c15
		z := x
		z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
		z = (z ^ z>>27) * 0x94d049bb133111eb
		return z ^ z>>31
	}
	for i := range keys {
		binary.LittleEndian.PutUint64(keys[i][:8], next())
		binary.LittleEndian.PutUint64(keys[i][8:], next())
	}
	return keys
}

// diskNode runs a node of 8 slots with disk tier dc in dir (a fresh one
// when ""), the writers held by hook when set, and one client of it.
func diskNode(t *testing.T, dc tiered.DiskConfig, lowWatermark int, hook func(Key)) (*Server, *Client) {
	t.Helper()
	if len(dc.Dirs) == 0 {
		dc.Dirs = []string{t.TempDir()}
	}
	if dc.CapacityBytes == 0 {
		dc.CapacityBytes = 8 << 20
	}
	s := startServer(t, ServerConfig{ClientShare: 1, PoolBytes: 8 * testSlot, RegionBytes: 8 * testSlot, LowWatermark: lowWatermark, Disk: &dc})
	if hook != nil {
		s.mu.Lock() // openDisk reads it under s.mu
		s.beforeDiskPut = hook
		s.mu.Unlock()
	}
	c := dial(t, s.Addr(), ClientConfig{})
	t.Cleanup(func() { c.Close() })
	if !c.WaitRegions(10 * time.Second) {
		t.Fatal("regions not mapped")
	}
	return s, c
}

// onDisk reports how many of keys, one at a time, a lookup finds on the
// node's disk (or being written there) and not in its pool.
func onDisk(t *testing.T, c *Client, keys []Key) (n int) {
	t.Helper()
	for _, k := range keys {
		h, l, _, err := c.LookupTiers([]Key{k}, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		if h == 0 && l == 1 {
			n++
		}
	}
	return n
}

// heldWriters is a beforeDiskPut hook that holds each write until
// released, reporting its key on entered.
type heldWriters struct {
	entered chan Key
	hold    chan struct{}
	once    sync.Once
}

func newHeldWriters(t *testing.T) *heldWriters {
	h := &heldWriters{entered: make(chan Key, 64), hold: make(chan struct{})}
	t.Cleanup(h.release) // before the node's Close (cleanups run last first)
	return h
}

func (h *heldWriters) hook(k Key) { h.entered <- k; <-h.hold }
func (h *heldWriters) release()   { h.once.Do(func() { close(h.hold) }) }

func (h *heldWriters) next(t *testing.T) Key {
	t.Helper()
	select {
	case k := <-h.entered:
		return k
	case <-time.After(10 * time.Second):
		t.Fatal("no write started")
		return Key{}
	}
}

// TestNodeDiskAdmission: with the default filter (seen twice) and a pool
// smaller than the working set, a block stored once and evicted is not
// written back; one stored and looked up (seen twice), then evicted, is,
// and a later BeginLoad promotes it byte-exact; nothing is written while
// no block is evicted; a node restarted on the directory finds the
// written-back blocks (not those its pool held at Close: write-back only).
func TestNodeDiskAdmission(t *testing.T) {
	dir := t.TempDir()
	dc := tiered.DiskConfig{Dirs: []string{dir}}
	s, c := diskNode(t, dc, 0, nil)
	keys := spreadKeys(1, 16)
	for _, k := range keys[:8] {
		storeOneBlock(t, c, k, Key{})
	}
	if h, _, _, err := c.LookupTiers(keys[:4], false, nil); err != nil || h != 4 {
		t.Fatalf("lookup of the hot keys: %d hits, %v", h, err)
	}
	if st := s.Stats(); st.DiskWrites != 0 || st.Cache.Evicted != 0 {
		t.Fatalf("before any eviction: %+v", st)
	}
	for _, k := range keys[8:] {
		storeOneBlock(t, c, k, Key{})
	}
	st := waitStats(t, s, "the hot blocks written back", func(st Stats) bool { return st.DiskWrites == 4 })
	if st.Cache.Evicted != 8 || st.DiskNotAdmitted != 4 || st.DiskDropped != 0 || st.DiskRecords != 4 {
		t.Fatalf("after 8 evictions: %+v", st)
	}
	// Watermark 0 (8 slots / 64): every victim's slot was needed at once.
	if st.DiskCopies != 4 || st.Cache.Demotions != 0 {
		t.Fatalf("copies %d, demotions %d; want 4, 0", st.DiskCopies, st.Cache.Demotions)
	}
	if n := onDisk(t, c, keys[4:8]); n != 0 {
		t.Fatalf("%d blocks stored once are on disk", n)
	}
	if n := onDisk(t, c, keys[:4]); n != 4 {
		t.Fatalf("%d of the 4 blocks seen twice are on disk", n)
	}
	loadChecked(t, c, keys[:4])
	if st := s.Stats(); st.DiskHits != 4 || st.DiskMisses != 0 {
		t.Fatalf("promotions: %+v", st)
	}

	// Restart: the written-back blocks are there, the pool's last ones
	// and those never admitted are not.
	c.Close()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s2, c2 := diskNode(t, dc, 0, nil)
	if n := onDisk(t, c2, keys[:4]); n != 4 {
		t.Fatalf("after a restart: %d of 4 written-back blocks on disk", n)
	}
	if n := onDisk(t, c2, keys[4:]); n != 0 {
		t.Fatalf("after a restart: %d blocks on disk that were never written", n)
	}
	loadChecked(t, c2, keys[:4])
	if st := s2.Stats(); st.DiskHits != 4 || st.DiskWrites != 0 {
		t.Fatalf("after the restart's load: %+v", st)
	}
}

// TestNodeDiskAdmitAll: AdmitAll writes back every evicted block and
// nothing else; the blocks still in the pool are not on disk.
func TestNodeDiskAdmitAll(t *testing.T) {
	s, c := diskNode(t, tiered.DiskConfig{AdmitAll: true}, 0, nil)
	keys := spreadKeys(2, 16)
	for _, k := range keys {
		storeOneBlock(t, c, k, Key{})
	}
	st := waitStats(t, s, "every eviction written back", func(st Stats) bool { return st.DiskWrites == 8 })
	if st.Cache.Evicted != 8 || st.DiskNotAdmitted != 0 || st.DiskRecords != 8 {
		t.Fatalf("after 8 evictions: %+v", st)
	}
	if n := onDisk(t, c, keys[:8]); n != 8 {
		t.Fatalf("%d of 8 evicted blocks on disk", n)
	}
	for _, k := range keys[8:] {
		if h, l, _, err := c.LookupTiers([]Key{k}, false, nil); err != nil || h != 1 || l != 0 {
			t.Fatalf("a pool block: %d hits, %d on disk, %v", h, l, err)
		}
	}
	loadChecked(t, c, keys[:8])
}

// TestNodeDiskDemoting: with a low-watermark, evictions run ahead of the
// stores and a written-back block goes from its demoting slot (no copy).
// While its write is held the block is out of the pool but readable: a
// lookup counts it on disk and BeginLoad promotes it byte-exact from the
// slot (DiskHitsWriting); once written its slot is freed (Demoted) and
// its record serves.
func TestNodeDiskDemoting(t *testing.T) {
	h := newHeldWriters(t)
	s, c := diskNode(t, tiered.DiskConfig{AdmitAll: true}, 2, h.hook)
	keys := spreadKeys(3, 8)
	for _, k := range keys {
		storeOneBlock(t, c, k, Key{})
	}
	first := h.next(t)
	st := s.Stats()
	if st.Cache.Demotions == 0 || st.Cache.Demoting == 0 || st.DiskCopies != 0 {
		t.Fatalf("a write-back held: demotions %d, demoting %d, copies %d", st.Cache.Demotions, st.Cache.Demoting, st.DiskCopies)
	}
	if h, l, _, err := c.LookupTiers([]Key{first}, false, nil); err != nil || h != 0 || l != 1 {
		t.Fatalf("a block being written back: %d hits, %d on disk, %v", h, l, err)
	}
	loadChecked(t, c, []Key{first})
	if st := s.Stats(); st.DiskHitsWriting != 1 || st.DiskHits != 1 {
		t.Fatalf("a promotion from the write in flight: %+v", st)
	}
	h.release()
	st = waitStats(t, s, "the write-backs done", func(st Stats) bool {
		// The promotion's store evicted a block for itself: copied.
		return st.Cache.Demoting == 0 && st.DiskWrites == int64(st.Cache.Demotions)+st.DiskCopies
	})
	if st.DiskRecords != st.DiskWrites || st.DiskWrites == 0 {
		t.Fatalf("after the writes: %+v", st)
	}
	// Every slot is back in use or free: none lost to demoting.
	if got := st.Cache.Free + st.Cache.Ready + st.Cache.Leased + st.Cache.Writing; got != 8 {
		t.Fatalf("slots free or holding blocks: %d of 8 (%+v)", got, st.Cache)
	}
	if err := s.cache.Verify(); err != nil {
		t.Fatal(err)
	}
}

// TestNodeDiskDropped: past WriteBackBytes of write-backs waiting (one
// slot's, held by its writer), an admitted eviction is dropped and
// counted, the evicting store not waiting; past QueueBlocks of
// write-throughs waiting, a ready block is not written through, counted.
func TestNodeDiskDropped(t *testing.T) {
	t.Run("write-back", func(t *testing.T) {
		h := newHeldWriters(t)
		s, c := diskNode(t, tiered.DiskConfig{AdmitAll: true, WriteBackBytes: testSlot}, 0, h.hook)
		keys := spreadKeys(4, 12)
		for _, k := range keys {
			storeOneBlock(t, c, k, Key{})
		}
		h.next(t)
		st := s.Stats()
		if st.Cache.Evicted != 4 || st.DiskDropped != 3 {
			t.Fatalf("4 evictions, one write-back allowed: evicted %d, dropped %d", st.Cache.Evicted, st.DiskDropped)
		}
		h.release()
		st = waitStats(t, s, "the one write-back", func(st Stats) bool { return st.DiskWrites == 1 })
		if st.DiskRecords != 1 || onDisk(t, c, keys[:4]) != 1 {
			t.Fatalf("after the write: %+v", st)
		}
	})
	t.Run("write-through", func(t *testing.T) {
		h := newHeldWriters(t)
		s, c := diskNode(t, tiered.DiskConfig{WriteThrough: true, QueueBlocks: 1}, 0, h.hook)
		keys := spreadKeys(5, 4)
		storeOneBlock(t, c, keys[0], Key{})
		if k := h.next(t); k != keys[0] {
			t.Fatalf("writing %v, want %v", k, keys[0])
		}
		for _, k := range keys[1:] {
			storeOneBlock(t, c, k, Key{})
		}
		if st := s.Stats(); st.DiskDropped != 2 {
			t.Fatalf("one being written, one queued, two dropped: %+v", st)
		}
		h.release()
		st := waitStats(t, s, "the write-throughs", func(st Stats) bool { return st.DiskWrites == 2 })
		if st.DiskRecords != 2 {
			t.Fatalf("after the writes: %+v", st)
		}
	})
}

// TestNodeDiskDeleteWhileDemoting: a Delete, or a Clear, of a block whose
// write-back is in progress leaves no record: the block is no longer
// served at once, its record is deleted once written, and a node
// restarted on the directory does not find it.
func TestNodeDiskDeleteWhileDemoting(t *testing.T) {
	for _, clear := range []bool{false, true} {
		name := map[bool]string{false: "delete", true: "clear"}[clear]
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			dc := tiered.DiskConfig{Dirs: []string{dir}, AdmitAll: true}
			h := newHeldWriters(t)
			s, c := diskNode(t, dc, 2, h.hook)
			keys := spreadKeys(6, 8)
			for _, k := range keys {
				storeOneBlock(t, c, k, Key{})
			}
			k := h.next(t)
			var err error
			if clear {
				_, err = c.Clear()
			} else {
				_, err = c.Delete([]Key{k})
			}
			if err != nil {
				t.Fatal(err)
			}
			if hits, l, _, err := c.LookupTiers([]Key{k}, false, nil); err != nil || hits != 0 || l != 0 {
				t.Fatalf("after %s: %d hits, %d on disk, %v", name, hits, l, err)
			}
			if res, err := c.BeginLoad([]Key{k}, nil); err != nil || res[0].Found {
				t.Fatalf("a BeginLoad after %s: %+v, %v", name, res, err)
			}
			h.release()
			st := waitStats(t, s, "the write-backs done", func(st Stats) bool {
				return st.Cache.Demoting == 0 && st.DiskWrites+st.DiskWriteErrors == int64(st.Cache.Demotions)+st.DiskCopies
			})
			if st.DiskWrites == 0 {
				t.Fatalf("nothing written: %+v", st)
			}
			if onDisk(t, c, []Key{k}) != 0 {
				t.Fatalf("the block's record is on disk after %s", name)
			}
			if clear && st.DiskRecords != 0 {
				t.Fatalf("%d records after a Clear during their writes", st.DiskRecords)
			}
			c.Close()
			if err := s.Close(); err != nil {
				t.Fatal(err)
			}
			_, c2 := diskNode(t, dc, 0, nil)
			if onDisk(t, c2, []Key{k}) != 0 {
				t.Fatalf("a restarted node finds the record deleted by %s", name)
			}
		})
	}
}

// TestNodeDiskConcurrent: clients store, look up, load (checking every
// block found byte for byte, promoted from disk or from a write in
// flight), delete and clear at once over a pool smaller than their blocks
// with write-back on; afterwards every write-back has finished, no slot is
// left demoting, the index's invariants hold, and a trim drains.
func TestNodeDiskConcurrent(t *testing.T) {
	s := startServer(t, ServerConfig{PoolBytes: 32 * testSlot, RegionBytes: 16 * testSlot, LowWatermark: 4,
		Disk: &tiered.DiskConfig{Dirs: []string{t.TempDir()}, CapacityBytes: 8 << 20, WriteBackBytes: 4 * testSlot}})
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for g := range 4 {
		c := dial(t, s.Addr(), ClientConfig{})
		defer c.Close()
		c.WaitRegions(10 * time.Second)
		wg.Go(func() {
			keys := spreadKeys(100+g, 24)
			for i := range 60 {
				chain := keys[(i%6)*4 : (i%6)*4+4]
				res, err := c.BeginStore(StoreRequest{Keys: chain}, nil)
				if err != nil {
					errs <- err
					return
				}
				var slots []Slot
				for j, r := range res {
					if r.Outcome == StoreWrite {
						fill(c.SlotBytes(r.Slot), chain[j])
						slots = append(slots, r.Slot)
					}
				}
				if err := c.CommitStore(slots); err != nil {
					errs <- err
					return
				}
				look := keys[((i+3)%6)*4 : ((i+3)%6)*4+4]
				if _, _, _, err := c.LookupTiers(look, false, nil); err != nil {
					errs <- err
					return
				}
				lr, err := c.BeginLoad(look, nil)
				if err != nil {
					errs <- err
					return
				}
				slots = slots[:0]
				for j, r := range lr {
					if r.Found {
						if err := check(c.SlotBytes(r.Slot), look[j]); err != nil {
							errs <- err
						}
						slots = append(slots, r.Slot)
					}
				}
				if err := c.EndLoad(slots); err != nil {
					errs <- err
					return
				}
				switch {
				case i%17 == 16 && g == 0:
					_, err = c.Clear()
				case i%5 == 4:
					_, err = c.Delete(look[:1])
				}
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	st := waitStats(t, s, "the write-backs done", func(st Stats) bool {
		return st.Cache.Demoting == 0 && st.DiskWrites+st.DiskWriteErrors == int64(st.Cache.Demotions)+st.DiskCopies
	})
	t.Logf("demotions %d copies %d writes %d hits %d from writes %d dropped %d records %d", st.Cache.Demotions, st.DiskCopies, st.DiskWrites, st.DiskHits, st.DiskHitsWriting, st.DiskDropped, st.DiskRecords)
	if st.Cache.Demotions == 0 || st.DiskHits == 0 || st.DiskWriteErrors != 0 {
		t.Fatalf("demotions %d, promotions %d, write errors %d", st.Cache.Demotions, st.DiskHits, st.DiskWriteErrors)
	}
	if err := s.cache.Verify(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Trim(16 * testSlot); err != nil {
		t.Fatal(err)
	}
	waitStats(t, s, "a region freed", func(st Stats) bool { return st.FreedBytes == 16*testSlot })
}
