package tiered

import (
	"bytes"
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/kvoffload/kvoffload/internal/tier/disk"
	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/stretchr/testify/require"
)

// rig is a Tier under a real kvcache.Cache over one region of pool
// memory, its records in t.TempDir().
type rig struct {
	t        *Tier
	c        *kvcache.Cache
	pool     []byte
	slot     int64
	released atomic.Int64
}

func newRig(t *testing.T, dc DiskConfig, slots int, mod func(*Config)) *rig {
	t.Helper()
	g := kvcache.Geometry{Layers: 1, KVHeads: 1, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16}
	layout, err := kvcache.NewLayout(kvcache.DenseRankSpec(kvcache.CrossLayer, g, kvcache.OrderUndeclared, kvcache.HeadRange{}, 16, 1<<30))
	require.NoError(t, err)
	r := &rig{slot: int64(layout.SlotSize())}
	r.pool = disk.AlignedBuffer(slots * int(r.slot))
	if dc.Dirs == nil {
		dc.Dirs = []string{t.TempDir()}
	}
	if dc.CapacityBytes == 0 {
		dc.CapacityBytes = 64 * disk.SlotBytes(r.slot)
	}
	dc.Direct = disk.DirectOff
	dc, err = dc.Check(255, nil)
	require.NoError(t, err)
	cfg := Config{Disk: dc, SlotBytes: r.slot, Fingerprint: 0x7e1d,
		Bytes:    func(s kvcache.Slot) []byte { return r.pool[s.Off : s.Off+uint64(r.slot)] },
		Released: func(kvcache.Slot) { r.released.Add(1) }}
	if mod != nil {
		mod(&cfg)
	}
	r.t, err = Open(cfg)
	require.NoError(t, err)
	kcfg := kvcache.Config{Layout: layout, Demote: r.t.Demote, OnDemote: r.t.OnDemote, OnIndex: func(e kvcache.IndexEvent) {
		if e.Ready {
			r.t.Ready(e.Key)
		}
	}}
	r.c, err = kvcache.New(kcfg)
	require.NoError(t, err)
	_, err = r.c.AddRegion(kvcache.Region{ID: 1, Base: uintptr(unsafe.Pointer(&r.pool[0])), Size: uint64(len(r.pool))})
	require.NoError(t, err)
	r.t.Start(r.c)
	t.Cleanup(func() {
		_ = r.t.Close(context.Background(), false)
		r.c.Close()
	})
	return r
}

func key(i byte) kvcache.Key { return kvcache.Key{i, 0x7e, 0x1d} }

func block(k kvcache.Key, n int64) []byte { return bytes.Repeat(k[:], int(n)/len(k)) }

// store stores keys' blocks (each key's bytes repeated) as one chain.
func (r *rig) store(t *testing.T, keys ...kvcache.Key) {
	t.Helper()
	res, err := r.c.BeginStore(kvcache.StoreRequest{Keys: keys, BlockIDs: make([]int, len(keys))}, nil)
	require.NoError(t, err)
	var slots []kvcache.Slot
	for i, x := range res {
		require.Equal(t, kvcache.StoreWrite, x.Outcome)
		copy(r.t.SlotBytes(x.Slot), block(keys[i], r.slot))
		slots = append(slots, x.Slot)
	}
	require.NoError(t, r.c.CompleteStore(slots, nil))
}

func (r *rig) flush(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, r.t.Flush(ctx))
}

func TestCheck(t *testing.T) {
	for _, tc := range []struct {
		dc   DiskConfig
		max  int
		want string
	}{
		{DiskConfig{CapacityBytes: 1}, 255, "Disk.Dirs is empty"},
		{DiskConfig{Dirs: []string{"d"}}, 255, "Disk.CapacityBytes = 0, must be positive"},
		{DiskConfig{Dirs: []string{"d"}, CapacityBytes: 1, QueueBlocks: -1}, 255, "Disk.QueueBlocks = -1"},
		{DiskConfig{Dirs: []string{"d"}, CapacityBytes: 1, WriteBackBytes: -1}, 255, "Disk.WriteBackBytes = -1"},
		{DiskConfig{Dirs: []string{"d"}, CapacityBytes: 1, AdmitAfter: 16}, 15, "Disk.AdmitAfter = 16, want 1 to 15 (0: the default, 2)"},
	} {
		_, err := tc.dc.Check(tc.max, nil)
		require.ErrorContains(t, err, tc.want)
	}
	dirs := []string{"d"}
	d, err := DiskConfig{Dirs: dirs, CapacityBytes: 1}.Check(255, nil)
	require.NoError(t, err)
	require.Equal(t, DefaultWriteBackBytes, d.WriteBackBytes)
	require.Equal(t, DefaultQueueBlocks, d.QueueBlocks)
	require.Equal(t, DefaultAdmitAfter, d.AdmitAfter)
	d.Dirs[0] = "e"
	require.Equal(t, "d", dirs[0], "Dirs copied")
	// The owner's checks run after the required fields, before the bounds.
	mine := errors.New("mine")
	_, err = DiskConfig{Dirs: dirs, CapacityBytes: 1, WriteBackBytes: -1}.Check(255, func() error { return mine })
	require.ErrorIs(t, err, mine)
	_, err = DiskConfig{CapacityBytes: 1}.Check(255, func() error { return mine })
	require.ErrorContains(t, err, "Disk.Dirs")
}

func TestByteSketch(t *testing.T) {
	s := &byteSketch{seen: make([]uint8, 1<<16)}
	k := key(1)
	for range 300 {
		s.Add([]kvcache.Key{k})
	}
	require.Equal(t, 255, s.Count(k), "saturates at 255")
	require.Equal(t, 0, s.Count(key(2)))
	other := make([]kvcache.Key, 1<<16)
	for i := range other {
		other[i] = kvcache.Key{0, 0, byte(i), byte(i >> 8), 1}
	}
	s.Add(other) // every bucket's count halves once len(seen) additions are in
	require.Less(t, s.Count(k), 255)
}

// TestAdmissionAndWriteBack: an eviction seen fewer than AdmitAfter times
// is not written back; one seen often enough is, from its demoting slot,
// the slot given back (Released), and Get reads it back.
func TestAdmissionAndWriteBack(t *testing.T) {
	r := newRig(t, DiskConfig{}, 2, nil)
	a, b, c := key(1), key(2), key(3)
	r.t.Saw([]kvcache.Key{a, a, b})
	r.store(t, a)
	r.store(t, b)
	r.store(t, c) // evicts a (LRU), needed at once: copied
	r.flush(t)
	require.True(t, r.t.Has(a))
	require.EqualValues(t, 1, r.t.WB.Writes.Load())
	require.EqualValues(t, 1, r.t.WB.Copies.Load())
	r.store(t, key(4)) // evicts b: seen once, not admitted
	r.flush(t)
	require.False(t, r.t.Has(b))
	require.EqualValues(t, 1, r.t.NotAdmitted.Load())
	require.Equal(t, 1, r.t.Prefix([]kvcache.Key{a, b}))
	got := disk.AlignedBuffer(int(r.slot))
	require.True(t, r.t.Get(a, got))
	require.Equal(t, block(a, r.slot), got)
	r.t.Delete([]kvcache.Key{a})
	require.False(t, r.t.Has(a))
}

// TestWriteThroughFromSlot: with ThroughFromSlot every ready block is
// written from its slot, leased meanwhile (Released after), whatever the
// admission filter; a Delete while it is written deletes its record once
// written.
func TestWriteThroughFromSlot(t *testing.T) {
	hold := make(chan struct{})
	var held atomic.Bool
	r := newRig(t, DiskConfig{WriteThrough: true}, 4, func(c *Config) {
		c.ThroughFromSlot = true
		c.BeforePut = func(k kvcache.Key) {
			if k == key(2) && held.CompareAndSwap(false, true) {
				<-hold
			}
		}
	})
	r.store(t, key(1))
	require.Eventually(t, func() bool { return r.t.Store.Contains(key(1)) }, 10*time.Second, time.Millisecond)
	require.EqualValues(t, 1, r.released.Load())
	r.store(t, key(2))
	require.Eventually(t, held.Load, 10*time.Second, time.Millisecond)
	r.t.Delete([]kvcache.Key{key(2)})
	close(hold)
	require.Eventually(t, func() bool { return r.released.Load() == 2 }, 10*time.Second, time.Millisecond)
	require.False(t, r.t.Store.Contains(key(2)), "deleted once written")
	require.EqualValues(t, 1, r.t.WB.Writes.Load())
}

// TestThroughCopies: Through copies the block now (the engine's
// write-through), counted in Throughs; once on disk, not again.
func TestThroughCopies(t *testing.T) {
	r := newRig(t, DiskConfig{WriteThrough: true}, 4, nil)
	mem := block(key(5), r.slot)
	r.t.Through(key(5), mem)
	r.flush(t)
	r.t.Through(key(5), mem)
	require.EqualValues(t, 1, r.t.Throughs.Load())
	require.True(t, r.t.Store.Contains(key(5)))
}

// TestReadAndSettle: Read fills reserved slots from their records
// (Readers at once), and Settle makes the good ones ready and releases
// the missing one.
func TestReadAndSettle(t *testing.T) {
	r := newRig(t, DiskConfig{WriteThrough: true}, 4, nil)
	r.t.Readers = 1
	for i := range byte(2) {
		r.t.Through(key(10+i), block(key(10+i), r.slot))
	}
	r.flush(t)
	keys := []kvcache.Key{key(10), key(11), key(12)} // 12 has no record
	res, err := r.c.BeginStore(kvcache.StoreRequest{Keys: keys, BlockIDs: make([]int, 3)}, nil)
	require.NoError(t, err)
	slots := make([]kvcache.Slot, 3)
	mems := make([][]byte, 3)
	for i, x := range res {
		slots[i], mems[i] = x.Slot, r.t.SlotBytes(x.Slot)
	}
	ok := make([]bool, 3)
	r.t.Read(context.Background(), keys, mems, func(i int, good bool) { ok[i] = good })
	require.Equal(t, []bool{true, true, false}, ok)
	good, err := Settle(r.c, slots, ok, errors.New("miss"), r.t.Promoted)
	require.NoError(t, err)
	require.Equal(t, 2, good)
	require.EqualValues(t, 2, r.t.Hits.Load())
	require.EqualValues(t, 1, r.t.Misses.Load())
	require.Equal(t, 2, r.c.Lookup(keys))
	// A context ended starts no read.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	r.t.Read(ctx, keys, mems, func(int, bool) { t.Error("a read started after ctx ended") })
}

// TestWriteBackAtClose: Close with atClose writes the pool's ready blocks
// not on disk yet (AtClose), and a Tier reopened on the directory finds
// them.
func TestWriteBackAtClose(t *testing.T) {
	dir := t.TempDir()
	r := newRig(t, DiskConfig{Dirs: []string{dir}, WriteBackOnClose: true}, 4, nil)
	r.store(t, key(20), key(21))
	require.NoError(t, r.t.Close(context.Background(), true))
	require.EqualValues(t, 2, r.t.AtClose.Load())
	require.NoError(t, r.t.Close(context.Background(), true), "closed already: nothing")
	r2 := newRig(t, DiskConfig{Dirs: []string{dir}}, 4, nil)
	require.Equal(t, 2, r2.t.Prefix([]kvcache.Key{key(20), key(21)}))
}
