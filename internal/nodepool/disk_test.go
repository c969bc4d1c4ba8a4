package nodepool

import (
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvoffload/kvoffload/internal/tiered"
)

// storeOneBlock stores key k through client c (bytes from fill) and
// commits it.
func storeOneBlock(t *testing.T, c *Client, k Key, parent Key) {
	t.Helper()
	res, err := c.BeginStore(StoreRequest{Keys: []Key{k}, Parent: parent}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if res[0].Outcome != StoreWrite {
		t.Fatalf("key %v: outcome %d", k, res[0].Outcome)
	}
	fill(c.SlotBytes(res[0].Slot), k)
	if err := c.CommitStore([]Slot{res[0].Slot}); err != nil {
		t.Fatal(err)
	}
}

// loadChecked begins a load of keys through c, checks that every key is
// found with its bytes (fill), and ends the load.
func loadChecked(t *testing.T, c *Client, keys []Key) {
	t.Helper()
	res, err := c.BeginLoad(keys, nil)
	if err != nil {
		t.Fatal(err)
	}
	var slots []Slot
	for i, r := range res {
		if !r.Found {
			t.Fatalf("key %d of %d not found", i, len(keys))
		}
		if err := check(c.SlotBytes(r.Slot), keys[i]); err != nil {
			t.Fatal(err)
		}
		slots = append(slots, r.Slot)
	}
	if err := c.EndLoad(slots); err != nil {
		t.Fatal(err)
	}
}

// TestNodeDisk: with a write-through disk tier (tiered.DiskConfig.WriteThrough)
// the node writes every committed block to disk from its slot; blocks the pool evicted are reported after the hits
// by LookupTiers and promoted by BeginLoad, byte-exact, for another
// client; a node restarted on the same directory finds every block on
// disk from the first lookup; Delete and Clear remove records; a second
// node on a directory in use serves without a disk tier and says why.
func TestNodeDisk(t *testing.T) {
	dir := t.TempDir()
	diskCfg := &tiered.DiskConfig{Dirs: []string{dir}, CapacityBytes: 8 << 20, WriteThrough: true}
	// A pool of 8 slots for 24 blocks: the first ones are evicted.
	s := startServer(t, ServerConfig{ClientShare: 1, PoolBytes: 8 * testSlot, RegionBytes: 8 * testSlot, Disk: diskCfg})
	a := dialMapped(t, s)
	keys := testKeys(7, 24)
	for i, k := range keys {
		// Each its own chain: a chain's blocks are no victims for its
		// own store, and 8 slots do not hold 24.
		storeOneBlock(t, a, k, Key{})
		waitStats(t, s, "write-through", func(st Stats) bool { return st.DiskWrites == int64(i+1) })
	}
	st := s.Stats()
	if st.Cache.Evicted == 0 {
		t.Fatalf("nothing evicted: %+v", st.Cache)
	}
	if st.DiskRecords != int64(len(keys)) || st.DiskDropped != 0 || st.DiskWriteErrors != 0 {
		t.Fatalf("disk after the stores: %+v", st)
	}

	b := dial(t, s.Addr(), ClientConfig{})
	defer b.Close()
	if !b.WaitRegions(10 * time.Second) {
		t.Fatal("regions not mapped")
	}
	hits, lower, _, err := b.LookupTiers(keys, false, nil)
	if err != nil || hits != 0 || lower != len(keys) {
		t.Fatalf("lookup of an evicted prefix: %d hits, %d on disk, %v; want 0, %d", hits, lower, err, len(keys))
	}
	loadChecked(t, b, keys[:4])
	if st := s.Stats(); st.DiskHits != 4 || st.DiskMisses != 0 {
		t.Fatalf("promotions: %+v", st)
	}
	hits, lower, _, err = b.LookupTiers(keys, false, nil)
	if err != nil || hits != 4 || lower != len(keys)-4 {
		t.Fatalf("after the promotion: %d hits, %d on disk, %v", hits, lower, err)
	}

	// A second node on the same directory: refused the lock, it serves
	// without the tier.
	s2 := startServer(t, ServerConfig{ClientShare: 1, PoolBytes: 8 * testSlot, RegionBytes: 8 * testSlot, Disk: diskCfg})
	c2 := dial(t, s2.Addr(), ClientConfig{})
	st2 := s2.Stats()
	if st2.DiskError == "" || !strings.Contains(st2.DiskError, dir) {
		t.Fatalf("a second node on %s: DiskError %q", dir, st2.DiskError)
	}
	if h, l, _, err := c2.LookupTiers(keys, false, nil); err != nil || h != 0 || l != 0 {
		t.Fatalf("a node without its tier: %d hits, %d lower, %v", h, l, err)
	}
	c2.Close()
	_ = s2.Close()

	// Restart on the same directory: the new node's pool is empty, its
	// disk holds every block.
	a.Close()
	b.Close()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s3 := startServer(t, ServerConfig{ClientShare: 1, PoolBytes: 8 * testSlot, RegionBytes: 8 * testSlot, Disk: diskCfg})
	c := dial(t, s3.Addr(), ClientConfig{})
	defer c.Close()
	if !c.WaitRegions(10 * time.Second) {
		t.Fatal("regions not mapped")
	}
	hits, lower, _, err = c.LookupTiers(keys, false, nil)
	if err != nil || hits != 0 || lower != len(keys) {
		t.Fatalf("after a restart: %d hits, %d on disk, %v", hits, lower, err)
	}
	loadChecked(t, c, keys[8:16])
	if st := s3.Stats(); st.DiskHits != 8 || st.DiskWrites != 0 {
		t.Fatalf("after the restart's load: %+v (promoted blocks are on disk already: not written again)", st)
	}

	// Delete and Clear reach the disk.
	if _, err := c.Delete(keys[20:21]); err != nil {
		t.Fatal(err)
	}
	if h, l, _, err := c.LookupTiers(keys[20:], false, nil); err != nil || h != 0 || l != 0 {
		t.Fatalf("a deleted key: %d hits, %d on disk, %v", h, l, err)
	}
	if h, l, _, err := c.LookupTiers(keys[21:], false, nil); err != nil || h+l != 3 {
		t.Fatalf("the keys after it: %d hits, %d on disk, %v", h, l, err)
	}
	if _, err := c.Clear(); err != nil {
		t.Fatal(err)
	}
	if h, l, _, err := c.LookupTiers(keys, false, nil); err != nil || h != 0 || l != 0 {
		t.Fatalf("after Clear: %d hits, %d on disk, %v", h, l, err)
	}
	if st := s3.Stats(); st.DiskRecords != 0 {
		t.Fatalf("after Clear: %d records", st.DiskRecords)
	}
}

// TestNodeDiskConfig: a bad disk configuration is refused by NewServer,
// naming the field.
func TestNodeDiskConfig(t *testing.T) {
	for _, tc := range []struct {
		cfg  tiered.DiskConfig
		want string
	}{
		{tiered.DiskConfig{CapacityBytes: 1 << 20}, "Disk.Dirs"},
		{tiered.DiskConfig{Dirs: []string{t.TempDir()}}, "Disk.CapacityBytes = 0"},
		{tiered.DiskConfig{Dirs: []string{t.TempDir()}, CapacityBytes: 1 << 20, QueueBlocks: -1}, "Disk.QueueBlocks = -1"},
		{tiered.DiskConfig{Dirs: []string{t.TempDir()}, CapacityBytes: 1 << 20, WriteBackBytes: -1}, "Disk.WriteBackBytes = -1"},
		{tiered.DiskConfig{Dirs: []string{t.TempDir()}, CapacityBytes: 1 << 20, AdmitAfter: -1}, "Disk.AdmitAfter = -1"},
		{tiered.DiskConfig{Dirs: []string{t.TempDir()}, CapacityBytes: 1 << 20, AdmitAfter: 16}, "Disk.AdmitAfter = 16, want 1 to 15"},
	} {
		_, err := NewServer(ServerConfig{Socket: filepath.Join(t.TempDir(), "s"), PoolBytes: 1 << 20, Disk: &tc.cfg})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", tc.cfg, err, tc.want)
		}
	}
}
