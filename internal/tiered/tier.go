package tiered

import (
	"context"
	"encoding/binary"
	"sync"
	"sync/atomic"

	"github.com/kvoffload/kvoffload/internal/tier/disk"
	"github.com/kvoffload/kvoffload/internal/tier/disk/writeback"
	"github.com/kvoffload/kvoffload/kvcache"
)

// Tier is a disk tier under one cache (see the package comment).
type Tier struct {
	// Store holds the records; WB is the write-back machine over it.
	Store *disk.Store
	WB    *writeback.Writer
	// Readers bounds a promotion's reads in flight (Read); default
	// Readers. Set before the first Read.
	Readers int

	cfg      Config
	cache    *kvcache.Cache // set by Start, before the writers start
	admitAll bool
	sketch   Sketch
	queue    chan kvcache.Key // the write-throughs from slots (nil without them)

	mu     sync.RWMutex // closed; held (read) while queueing a write-through
	closed bool
	wg     sync.WaitGroup // the write-through writer

	// The write-through writer's block in progress, and whether a Delete
	// or Clear came for it meanwhile (its record is then deleted once
	// written).
	curMu   sync.Mutex
	cur     kvcache.Key
	writing bool
	curGone bool

	// LookupHits (counted by the owner: keys found on disk after a
	// lookup's hits), Hits and Misses (promotions read, and whose record
	// was missing or damaged: counted by the owner, Promoted),
	// NotAdmitted (evictions the filter refused), Throughs (write-through
	// copies accepted, Through), AtClose and LeftAtClose
	// (WriteBackAtClose). The Puts, drops, copies and reads served from a
	// write-back are WB's.
	LookupHits, Hits, Misses, NotAdmitted, Throughs, AtClose, LeftAtClose atomic.Int64
}

// Open opens the Store of cfg and the write-back machine over it; Start
// then hands the Tier its cache and starts its writers. Its error is
// internal/tier/disk's Open's (disk.ErrConfig, disk.ErrNoUsableDir, ...), for the
// owner to wrap.
func Open(cfg Config) (*Tier, error) {
	dc := cfg.Disk
	st, err := disk.Open(disk.Config{Dirs: dc.Dirs, CapacityBytes: dc.CapacityBytes, RecordPayloadBytes: cfg.SlotBytes,
		Fingerprint: cfg.Fingerprint, Fsync: dc.Fsync, Direct: dc.Direct, ZeroOnRelease: cfg.ZeroOnRelease,
		RemoveRecords: dc.RemoveRecords, OnStore: cfg.OnStore, OnRemove: cfg.OnRemove, Faults: cfg.Faults})
	if err != nil {
		return nil, err
	}
	t := &Tier{Store: st, Readers: Readers, cfg: cfg}
	if !dc.AdmitAll && dc.AdmitAfter > 1 {
		t.sketch = cfg.Sketch
		if t.sketch == nil {
			t.sketch = &byteSketch{seen: make([]uint8, 1<<16)}
		}
	}
	t.admitAll = t.sketch == nil
	t.WB = writeback.New(writeback.Config{Store: st, SlotBytes: int(cfg.SlotBytes),
		MaxBusy: int(max(dc.WriteBackBytes/cfg.SlotBytes, 1)), Writers: Writers, Bytes: cfg.Bytes,
		Demoted: func(s kvcache.Slot) {
			_ = t.cache.Demoted([]kvcache.Slot{s}) // a slot OnDemote was given: only a bug fails
			t.released(s)
		},
		BeforePut: cfg.BeforePut, BeforeGet: cfg.BeforeGet, TombKeys: cfg.TombKeys})
	if dc.WriteThrough && cfg.ThroughFromSlot {
		t.queue = make(chan kvcache.Key, dc.QueueBlocks)
	}
	return t, nil
}

// Start hands the Tier its cache (whose Config.Demote and OnDemote are
// the Tier's) and starts its writers.
func (t *Tier) Start(c *kvcache.Cache) {
	t.cache = c
	t.WB.Start()
	if t.queue != nil {
		t.wg.Add(1)
		go t.writeThrough()
	}
}

func (t *Tier) released(s kvcache.Slot) {
	if t.cfg.Released != nil {
		t.cfg.Released(s)
	}
}

// SlotBytes is Config.Bytes: slot s's bytes, nil when its memory is gone.
func (t *Tier) SlotBytes(s kvcache.Slot) []byte { return t.cfg.Bytes(s) }

// WritesThrough reports DiskConfig.WriteThrough.
func (t *Tier) WritesThrough() bool { return t.cfg.Disk.WriteThrough }

// Saw counts uses of keys (stores and lookups) for admission.
func (t *Tier) Saw(keys []kvcache.Key) {
	if t.admitAll || len(keys) == 0 {
		return
	}
	t.sketch.Add(keys)
}

func (t *Tier) admitted(k kvcache.Key) bool {
	return t.admitAll || t.sketch.Count(k) >= t.cfg.Disk.AdmitAfter
}

// Demote is the cache's Config.Demote, under its lock: a key the
// admission filter refuses is counted (NotAdmitted); an admitted one goes
// to the write-back machine (writeback.Writer.Demote: accepted, or on
// disk or being written already, or dropped; copied now when the evicting
// store needs the slot). Never waits.
func (t *Tier) Demote(s kvcache.Slot, k kvcache.Key, needed bool) bool {
	if !t.admitted(k) {
		t.NotAdmitted.Add(1)
		return false
	}
	return t.WB.Demote(s, k, needed)
}

// OnDemote is the cache's Config.OnDemote: slot s, demoting, is held
// (Config.Hold), then queued for a writer, which Puts it straight from
// the slot's memory and gives it back (Cache.Demoted, then Released).
// Never blocks.
func (t *Tier) OnDemote(s kvcache.Slot, k kvcache.Key) {
	if t.cfg.Hold != nil {
		t.cfg.Hold(s)
	}
	t.WB.OnDemote(s, k)
}

// Through writes a stored block (key k, mem its slot's bytes, which its
// caller holds until Through returns) to disk (WriteThrough, from a copy):
// copied into a buffer now, Put by a writer. Dropped, counted, when
// MaxBusy writes are accepted and unfinished; nothing when k is on disk.
// Never waits.
func (t *Tier) Through(k kvcache.Key, mem []byte) {
	if t.WB.Copy(k, mem) {
		t.Throughs.Add(1)
	}
}

// Ready queues a block that became ready for its write-through from its
// slot (Config.ThroughFromSlot; from the cache's OnIndex, under its lock:
// never blocks). Past QueueBlocks waiting it is dropped (counted).
func (t *Tier) Ready(k kvcache.Key) {
	if t.queue == nil {
		return
	}
	t.mu.RLock()
	defer t.mu.RUnlock()
	if t.closed {
		return
	}
	select {
	case t.queue <- k:
	default:
		t.WB.Dropped.Add(1)
	}
}

// writeThrough writes queued ready blocks to disk from their slots: each
// is held by a reader hold (a lease the policy does not hear of) while it
// is written, so its slot is not reused; a block already on disk, or gone
// from the pool meanwhile, is skipped.
func (t *Tier) writeThrough() {
	defer t.wg.Done()
	var slots []kvcache.Slot
	for k := range t.queue {
		if t.Has(k) {
			continue
		}
		// Current before the lookup: a Delete or Clear from here on marks
		// it gone; one before finds it in the pool, or makes it a miss.
		t.curMu.Lock()
		t.cur, t.writing, t.curGone = k, true, false
		t.curMu.Unlock()
		var n int
		n, slots = t.cache.LookupLeaseDeferred([]kvcache.Key{k}, slots[:0])
		if n > 0 {
			if t.cfg.BeforePut != nil {
				t.cfg.BeforePut(k)
			}
			err := t.Store.Put(k, t.cfg.Bytes(slots[0]))
			t.curMu.Lock()
			gone := t.curGone
			t.curMu.Unlock()
			switch {
			case err != nil:
				t.WB.WriteErrors.Add(1)
			case gone:
				t.Store.Delete(k)
			default:
				t.WB.Writes.Add(1)
			}
			_ = t.cache.Unlease(slots[:1])
			t.released(slots[0])
		}
		t.curMu.Lock()
		t.writing = false
		t.curMu.Unlock()
	}
}

// Delete removes keys' records, including those being written: the
// write-through in progress and the write-backs in flight are marked gone
// first (no longer served, their records deleted once written), then the
// store deletes.
func (t *Tier) Delete(keys []kvcache.Key) {
	t.curMu.Lock()
	for _, k := range keys {
		if t.writing && k == t.cur {
			t.curGone = true
		}
	}
	t.curMu.Unlock()
	t.WB.Delete(keys)
}

// Clear removes every record (records carry no namespace), including
// those being written.
func (t *Tier) Clear() {
	t.curMu.Lock()
	t.curGone = t.writing
	t.curMu.Unlock()
	t.WB.Clear()
}

// Prefix returns how many leading keys have a record on disk or a
// write-back in flight (memory only).
func (t *Tier) Prefix(keys []kvcache.Key) int { return t.WB.Prefix(keys) }

// Has reports whether key's block is on disk or being written there
// (readable meanwhile): memory only, never I/O.
func (t *Tier) Has(k kvcache.Key) bool { return t.WB.Contains(k) }

// Get reads key's block into mem, from its write-back in flight if there
// is one (WB.Served), else from its record (BeforeGet first); true when
// mem holds its verified block.
func (t *Tier) Get(k kvcache.Key, mem []byte) bool { return t.WB.Get(k, mem) }

// Flush waits until every write-back queued has been written (or failed),
// or ctx ends.
func (t *Tier) Flush(ctx context.Context) error { return t.WB.Flush(ctx) }

// Read reads the records of keys into mems (a promotion's reserved
// slots; an empty mem is skipped), Readers at once, started in key order,
// and calls done(i, ok) as each read ends (ok: mems[i] holds keys[i]'s
// verified block). Once ctx has ended no further read starts (those keys
// get no done). It returns once every read it started has ended.
func (t *Tier) Read(ctx context.Context, keys []kvcache.Key, mems [][]byte, done func(i int, ok bool)) {
	sem := make(chan struct{}, max(t.Readers, 1))
	var wg sync.WaitGroup
	for i := range keys {
		if len(mems[i]) == 0 {
			continue
		}
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			break
		}
		wg.Go(func() {
			defer func() { <-sem }()
			done(i, t.WB.Get(keys[i], mems[i]))
		})
	}
	wg.Wait()
}

// Promoted counts a promotion's reads: good blocks made ready, bad ones
// whose record was missing or damaged.
func (t *Tier) Promoted(good, bad int) {
	t.Hits.Add(int64(good))
	t.Misses.Add(int64(bad))
}

// WriteBackAtClose writes the pool's ready blocks that are not on disk
// yet (DiskConfig.WriteBackOnClose; nothing without it) from their slots,
// leased meanwhile (LeaseAll: ready blocks only, never a slot reserved for
// a store), with Writers goroutines (internal/tier/disk Store.PutAll). It starts no
// block once ctx has ended: those left that the store does not hold are
// counted (LeftAtClose). A write the store refuses counts as a write
// error. It returns the Unlease's error (only a bug fails).
func (t *Tier) WriteBackAtClose(ctx context.Context) error {
	if !t.cfg.Disk.WriteBackOnClose || t.cache == nil {
		return nil
	}
	slots, keys := t.cache.LeaseAll(nil, nil)
	if len(slots) == 0 {
		return nil
	}
	var before func(int)
	if f := t.cfg.BeforePutAtClose; f != nil {
		before = func(i int) { f(keys[i]) }
	}
	written, failed, left := t.Store.PutAll(ctx, len(slots), Writers,
		func(i int) [16]byte { return keys[i] },
		func(i int) []byte { return t.cfg.Bytes(slots[i]) }, // leased: its region is mapped
		before)
	t.AtClose.Add(written)
	t.WB.WriteErrors.Add(failed)
	t.LeftAtClose.Add(left)
	return t.cache.Unlease(slots)
}

// Close writes the blocks still queued (write-throughs and write-backs; a
// demoting slot is given back once written), stops the writers, with
// atClose writes the pool's blocks (WriteBackAtClose, within ctx), and
// closes the store. Closed already: nothing. A block accepted and not
// demoting yet (a reader still held it) is given back unwritten when its
// reader ends, counted dropped.
func (t *Tier) Close(ctx context.Context, atClose bool) error {
	t.mu.Lock()
	if !t.closed && t.queue != nil {
		close(t.queue)
	}
	t.closed = true
	t.mu.Unlock()
	if !t.WB.Close() {
		return nil
	}
	t.wg.Wait()
	if atClose {
		_ = t.WriteBackAtClose(ctx)
	}
	return t.Store.Close()
}

// byteSketch is the Tier's own admission sketch: saturating use counts
// (up to 255) by key hash, halved every len(seen) additions.
type byteSketch struct {
	mu   sync.Mutex
	seen []uint8
	adds int
}

func (s *byteSketch) Add(keys []kvcache.Key) {
	s.mu.Lock()
	for _, k := range keys {
		b := binary.LittleEndian.Uint64(k[:8]) % uint64(len(s.seen))
		if s.seen[b] < 255 {
			s.seen[b]++
		}
		if s.adds++; s.adds >= len(s.seen) {
			s.adds = 0
			for i := range s.seen {
				s.seen[i] >>= 1
			}
		}
	}
	s.mu.Unlock()
}

func (s *byteSketch) Count(k kvcache.Key) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return int(s.seen[binary.LittleEndian.Uint64(k[:8])%uint64(len(s.seen))])
}
