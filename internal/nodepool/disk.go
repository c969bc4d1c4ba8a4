package nodepool

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/kvoffload/kvoffload/internal/kvseen"
	"github.com/kvoffload/kvoffload/internal/tier/disk"
	"github.com/kvoffload/kvoffload/internal/tier/disk/writeback"
	"github.com/kvoffload/kvoffload/internal/tier/record"
	"github.com/kvoffload/kvoffload/kvcache"
)

// DiskConfig puts a disk tier (tier/disk) under the node's pool
// (ServerConfig.Disk). The node does the disk I/O, straight between its
// records and the pool's slots; clients only copy between slots and their
// GPU, as without a disk tier.
//
// By default, as in the embedded engine (offload.DiskConfig), the tier is
// written back: a block the pool's policy evicts is written to disk if
// its key passes the admission filter (seen at least AdmitAfter times,
// default 2: stores and lookups through the node counted in
// kvseen.Counter; AdmitAll takes every eviction) and is not on disk
// already, within WriteBackBytes of write-backs waiting (beyond it the
// eviction is dropped, Stats.DiskDropped). An accepted block leaves the
// index at once but stays readable until its write ends: a Lookup counts
// it on disk, a BeginLoad promotes it from the bytes it is written from.
// Evicted ahead of demand (the low-watermark, ServerConfig.LowWatermark),
// its slot goes into kvcache's "demoting" state (bytes intact, never
// handed to a store, its region not releasable) and a writer writes it
// straight from the slot, then frees it (kvcache.Cache.Demoted). Evicted
// by a store that needs its slot at once, it is copied out first (under
// the cache's lock; Stats.DiskCopies) and written from the copy.
//
// WriteThrough also writes every block that becomes ready (a client's
// commit) from its slot, in the background, the slot held meanwhile by a
// reader hold the policy does not hear of (so it is not reused before its
// write ends), past QueueBlocks waiting dropped (Stats.DiskDropped): a
// restart then finds every block stored, not only those evicted (the
// node's only mode before write-back; `kvoffload serve
// --disk-write-through`). Evictions are still written back as above when
// their block is not on disk yet.
//
// A Lookup reports, after the pool's hits, how many following keys the
// disk holds (LookupTiers); a BeginLoad of such keys promotes them first:
// the node reserves slots for them as a store would, reads their records
// into the slots (eight reads at once), makes the good ones ready and
// hands them out as found. A record that fails a check (tier/record) is a
// miss. Delete deletes the keys' records, also one being written (deleted
// once written); Clear of any namespace empties the tier.
//
// WriteBackOnClose has the node's Close write the pool's ready blocks that
// are not on disk yet, as the embedded engine's Close does
// (offload.DiskConfig.WriteBackOnClose), bounded by CloseContext's
// context (see the field).
type DiskConfig struct {
	// Dirs are the records' directories, each locked (flock) by this node
	// for its life. Required.
	Dirs []string
	// CapacityBytes bounds the records files' total size; the tier evicts
	// its oldest records beyond it. Required.
	CapacityBytes int64
	// Fsync and Direct are tier/disk's (default: no fsync, O_DIRECT where
	// the file system takes it).
	Fsync  disk.FsyncPolicy
	Direct disk.DirectMode
	// WriteBackBytes bounds the bytes of evicted blocks waiting for their
	// disk write: demoting slots (the pool holds that many blocks fewer
	// meanwhile) and copies of slots a store needed at once (allocated as
	// first needed). An eviction past it is not written back
	// (Stats.DiskDropped). Default DefaultWriteBackBytes; at least one
	// slot.
	WriteBackBytes int64
	// AdmitAll writes back every evicted block. By default only blocks
	// whose key was seen at least AdmitAfter times (stored or looked up
	// through the node) are: a block used once is not worth a disk write.
	AdmitAll bool
	// AdmitAfter is how many times a key must have been seen before its
	// evicted block is written back: default 2 (as Dynamo's G3), at most
	// kvseen.Max (15: the sketch's counters saturate there; the
	// embedded engine takes up to 255); 1 admits every block. A store of
	// head ranges counts once per block (the range that starts at head 0).
	// Ignored with AdmitAll.
	AdmitAfter int
	// WriteThrough also writes every block that becomes ready, whatever
	// the admission filter (see above).
	WriteThrough bool
	// QueueBlocks bounds the blocks waiting for their write-through
	// (WriteThrough); a block that finds the queue full is not written
	// through (Stats.DiskDropped). Default 256.
	QueueBlocks int
	// WriteBackOnClose has Close write every ready block in the pool that
	// is not on disk yet, whatever the admission filter, before it releases
	// the pool: a restart then finds what the pool held at the end, not
	// only what was evicted or written through (`kvoffload serve
	// --disk-write-back-on-close`). It runs once the clients are
	// disconnected and the write-backs and write-throughs queued are
	// written, over the ready blocks only (leased meanwhile,
	// kvcache.Cache.LeaseAll: a block a client leased or is loading is
	// complete and is written; a slot reserved for a store and never
	// committed is not, whoever holds it, and no client is waited for),
	// from their slots, with diskWriters goroutines, through the same
	// store and record format as the write-backs. Close takes as long as
	// those blocks take at the disk's rate (a 64 GiB pool about 30 s at
	// 2 GB/s), bounded by CloseContext's context: once it ends no further
	// block is started (the writes in progress, one a writer, finish) and
	// the blocks not on disk that were not written are counted
	// (Stats.DiskLeftAtClose). The blocks go most recently used first with
	// the LRU policy (the default; kvcache.Cache.LeaseAll), so a bound too
	// short for the pool keeps the hottest; with tinylfu, in slot order. A block already evicted and accepted for its
	// write-back but still read by a client when the tier closes is not
	// written (it is no longer in the pool's index). A block the tier's capacity cannot hold
	// evicts its oldest records, as any write does. Counted in
	// Stats.DiskWrittenAtClose (not in DiskWrites).
	WriteBackOnClose bool
	// RemoveRecords names records files of other layouts (tier/disk's
	// Config.RemoveRecords) to remove from the directories when the tier
	// opens; by default another layout's records file is kept beside the
	// node's.
	RemoveRecords []string
}

// DefaultWriteBackBytes is DiskConfig.WriteBackBytes's default (the
// embedded engine's, offload.DefaultWriteBackBytes).
const DefaultWriteBackBytes int64 = 64 << 20

// nodeDiskNamespace is the namespace in the fingerprint of the node's
// records: one node serves one slot layout (its first client's) for every
// namespace, and its keys name their namespace's prefixes themselves.
const nodeDiskNamespace = "kvoffload-node"

// diskReadsAtOnce bounds a promotion's disk reads in flight.
const diskReadsAtOnce = 8

// diskWriters is the number of goroutines writing evicted blocks back.
const diskWriters = 2

// nodeDisk is the node's disk tier: the store, the admission counts, the
// write-back machine (tier/disk/writeback: the write-backs accepted and not
// finished, readable meanwhile, with their writers), the write-through
// queue and its writer, and the counters.
//
// Lock order: the cache's lock (Demote runs under it), then the
// write-back machine's locks (writeback's package comment); onReady takes
// mu (read) under the cache's lock. Nothing here takes the Server's mu
// under the cache's lock: slot bytes come from mem, fixed at open.
type nodeDisk struct {
	store      *disk.Store
	wb         *writeback.Writer
	cache      *kvcache.Cache // set before the writers start
	slot       uint64
	mem        map[uint32][]byte            // the node's mapping of each region at open (the pool is fixed at start)
	seen       *kvseen.Counter[kvcache.Key] // nil: every eviction is admitted
	admitAfter int                          // DiskConfig.AdmitAfter
	reap       func()                       // Server.reap: a demoting slot freed may end a region's drain
	beforePut  func(kvcache.Key)            // test hook, run by every writer before each Put
	queue      chan kvcache.Key             // write-through (nil without WriteThrough)

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

	lookupHits, hits, misses, notAdmitted atomic.Int64
	atClose, leftAtClose                  atomic.Int64 // WriteBackOnClose
}

// openDisk opens the disk tier for layout (newCache, s.mu held, before
// the cache exists: its Demote and OnDemote are the tier's). start then
// hands it the cache and starts its writers. An error leaves the node
// serving without it (Stats.DiskError).
func (s *Server) openDisk(layout *kvcache.Layout, kind kvcache.LayoutKind) (*nodeDisk, error) {
	dc := s.cfg.Disk
	g := layout.Geometry()
	fp := record.Fingerprint(record.Geometry{Namespace: []byte(nodeDiskNamespace), KVHeads: g.KVHeads, Layers: g.Layers,
		HeadDim: g.HeadDim, DTypeBytes: g.DTypeBytes, TokensPerBlock: g.TokensPerBlock, LayoutKind: uint8(kind),
		HostFormat: uint8(record.HostDeviceOrder)})
	slot := layout.SlotSize()
	st, err := disk.Open(disk.Config{Dirs: dc.Dirs, CapacityBytes: dc.CapacityBytes, RecordPayloadBytes: int64(slot),
		Fingerprint: fp, Fsync: dc.Fsync, Direct: dc.Direct, RemoveRecords: dc.RemoveRecords})
	if err != nil {
		return nil, fmt.Errorf("nodepool: opening the disk tier (Disk.Dirs %q): %w", dc.Dirs, err)
	}
	d := &nodeDisk{store: st, slot: slot, mem: map[uint32][]byte{}, admitAfter: dc.AdmitAfter,
		reap: func() { s.reap() }, beforePut: s.beforeDiskPut}
	d.wb = writeback.New(writeback.Config{Store: st, SlotBytes: int(slot), MaxBusy: int(max(dc.WriteBackBytes/int64(slot), 1)),
		Writers: diskWriters, Bytes: d.slotBytes,
		Demoted: func(sl kvcache.Slot) {
			_ = d.cache.Demoted([]kvcache.Slot{sl}) // a slot onDemote was given: only a bug fails
			d.reap()
		},
		BeforePut: s.beforeDiskPut, BeforeGet: s.beforeDiskGet})
	if !dc.AdmitAll && dc.AdmitAfter > 1 {
		d.seen = kvseen.NewCounter[kvcache.Key]()
	}
	if dc.WriteThrough {
		d.queue = make(chan kvcache.Key, dc.QueueBlocks)
	}
	for id, rr := range s.regions {
		d.mem[id] = rr.r.Bytes()
	}
	return d, nil
}

// start hands the tier its cache and starts its writers (newCache, once
// the cache has its regions).
func (d *nodeDisk) start(c *kvcache.Cache) {
	d.cache = c
	d.wb.Start()
	if d.queue != nil {
		d.wg.Add(1)
		go d.writeThrough()
	}
}

// checkDisk checks ServerConfig.Disk and fills its defaults (NewServer).
func checkDisk(dc *DiskConfig) (*DiskConfig, error) {
	if dc == nil {
		return nil, nil
	}
	d := *dc
	d.Dirs = append([]string(nil), d.Dirs...)
	switch {
	case len(d.Dirs) == 0:
		return nil, errors.New("nodepool: Disk.Dirs is empty: name at least one directory")
	case d.CapacityBytes <= 0:
		return nil, fmt.Errorf("nodepool: Disk.CapacityBytes = %d, must be positive", d.CapacityBytes)
	case d.QueueBlocks < 0:
		return nil, fmt.Errorf("nodepool: Disk.QueueBlocks = %d, must not be negative", d.QueueBlocks)
	case d.WriteBackBytes < 0:
		return nil, fmt.Errorf("nodepool: Disk.WriteBackBytes = %d, must not be negative", d.WriteBackBytes)
	case d.AdmitAfter < 0 || d.AdmitAfter > kvseen.Max:
		return nil, fmt.Errorf("nodepool: Disk.AdmitAfter = %d, want 1 to %d (0: the default, 2)", d.AdmitAfter, kvseen.Max)
	}
	if d.QueueBlocks == 0 {
		d.QueueBlocks = 256
	}
	if d.WriteBackBytes == 0 {
		d.WriteBackBytes = DefaultWriteBackBytes
	}
	if d.AdmitAfter == 0 {
		d.AdmitAfter = 2
	}
	return &d, nil
}

// slotBytes returns slot sl's bytes in the node's mapping of its region
// (nil for a region the node never had). The caller holds the slot (a
// lease, a reservation, or a demoting or evicting slot under the cache's
// lock): its region is mapped meanwhile. Never takes a lock.
func (d *nodeDisk) slotBytes(sl kvcache.Slot) []byte {
	mem := d.mem[uint32(sl.Region)]
	if sl.Off+d.slot > uint64(len(mem)) {
		return nil
	}
	return mem[sl.Off : sl.Off+d.slot]
}

// saw counts uses of keys (stores and lookups) for admission.
func (d *nodeDisk) saw(keys []kvcache.Key) {
	if d.seen != nil {
		d.seen.Add(keys)
	}
}

func (d *nodeDisk) admitted(k kvcache.Key) bool {
	return d.seen == nil || d.seen.Count(k) >= d.admitAfter
}

// demote is the cache's Config.Demote, under its lock: a key the
// admission filter refuses is counted (DiskNotAdmitted); an admitted one
// goes to the write-back machine (writeback.Writer.Demote: accepted, or on
// disk or being written already, or dropped; copied now when the evicting
// store needs the slot). Never waits.
func (d *nodeDisk) demote(s kvcache.Slot, k kvcache.Key, needed bool) bool {
	if !d.admitted(k) {
		d.notAdmitted.Add(1)
		return false
	}
	return d.wb.Demote(s, k, needed)
}

// onReady queues a block that became ready for its write-through (from
// the cache's OnIndex, under its lock: never blocks).
func (d *nodeDisk) onReady(k kvcache.Key) {
	if d.queue == nil {
		return
	}
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return
	}
	select {
	case d.queue <- k:
	default:
		d.wb.Dropped.Add(1)
	}
}

// writeThrough writes queued ready blocks to disk from their slots
// (WriteThrough): each is held by a reader hold (a lease the policy does
// not hear of) while it is written, so its slot is not reused; a block
// already on disk, or gone from the pool meanwhile, is skipped.
func (d *nodeDisk) writeThrough() {
	defer d.wg.Done()
	var slots []kvcache.Slot
	for k := range d.queue {
		if d.has(k) {
			continue
		}
		// Current before the lookup: a Delete or Clear from here on marks
		// it gone; one before finds it in the pool, or makes it a miss.
		d.curMu.Lock()
		d.cur, d.writing, d.curGone = k, true, false
		d.curMu.Unlock()
		var n int
		n, slots = d.cache.LookupLeaseDeferred([]kvcache.Key{k}, slots[:0])
		if n > 0 {
			if d.beforePut != nil {
				d.beforePut(k)
			}
			err := d.store.Put(k, d.slotBytes(slots[0]))
			d.curMu.Lock()
			gone := d.curGone
			d.curMu.Unlock()
			switch {
			case err != nil:
				d.wb.WriteErrors.Add(1)
			case gone:
				d.store.Delete(k)
			default:
				d.wb.Writes.Add(1)
			}
			_ = d.cache.Unlease(slots[:1])
			d.reap()
		}
		d.curMu.Lock()
		d.writing = false
		d.curMu.Unlock()
	}
}

// diskPrefix returns how many leading keys the disk holds, or a
// write-back in flight (memory only).
func (d *nodeDisk) diskPrefix(keys []kvcache.Key) int { return d.wb.Prefix(keys) }

// has reports whether key's block is on disk or being written there
// (readable meanwhile): memory only, never I/O.
func (d *nodeDisk) has(k kvcache.Key) bool { return d.wb.Contains(k) }

// promote brings the keys at pos (missing from the pool, held by the disk
// or a write-back in flight) into the pool for a BeginLoad or a Promote:
// slots reserved as a store of namespace ns would (key j's parent
// parent(j): one chain per run of them), records read straight into them
// (diskReadsAtOnce at once), the good ones made ready. It returns nothing:
// the caller's BeginLoad finds what was promoted.
func (s *Server) promote(ns kvcache.Namespace, keys []kvcache.Key, parent func(j int) kvcache.Key, pos []int) {
	d := s.disk
	c := s.cache
	var pkeys []kvcache.Key
	for _, j := range pos {
		pkeys = append(pkeys, keys[j])
	}
	// One BeginStore per run of consecutive positions that chain.
	var slots []kvcache.Slot
	var skeys []kvcache.Key
	for i := 0; i < len(pos); {
		j := i + 1
		for j < len(pos) && pos[j] == pos[j-1]+1 && parent(pos[j]) == keys[pos[j-1]] {
			j++
		}
		res, err := c.BeginStore(kvcache.StoreRequest{Namespace: ns, Parent: parent(pos[i]), Keys: pkeys[i:j], BlockIDs: blockIDs[:j-i]}, nil)
		if err == nil {
			for k, r := range res {
				if r.Outcome == kvcache.StoreWrite {
					slots, skeys = append(slots, r.Slot), append(skeys, pkeys[i+k])
				}
			}
		}
		i = j
	}
	if len(slots) == 0 {
		return
	}
	ok := make([]bool, len(slots))
	sem := make(chan struct{}, diskReadsAtOnce)
	var wg sync.WaitGroup
	for i := range slots {
		mem := d.slotBytes(slots[i])
		if len(mem) == 0 {
			continue
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			ok[i] = d.wb.Get(skeys[i], mem)
		})
	}
	wg.Wait()
	var good, bad []kvcache.Slot
	for i, sl := range slots {
		if ok[i] {
			good = append(good, sl)
		} else {
			bad = append(bad, sl)
		}
	}
	d.hits.Add(int64(len(good)))
	d.misses.Add(int64(len(bad)))
	if len(bad) > 0 {
		_ = c.CompleteStore(bad, errDiskMiss)
	}
	if len(good) > 0 {
		_ = c.CompleteStore(good, nil)
	}
	s.reap()
}

var errDiskMiss = errors.New("nodepool: disk record missing or damaged")

// delete removes keys' records (Delete), including those being written:
// the write-through in progress and the write-backs in flight are marked
// gone first (no longer served, their records deleted once written), then
// the store deletes.
func (d *nodeDisk) delete(keys []kvcache.Key) {
	d.curMu.Lock()
	for _, k := range keys {
		if d.writing && k == d.cur {
			d.curGone = true
		}
	}
	d.curMu.Unlock()
	d.wb.Delete(keys)
}

// clear removes every record (Clear of any namespace: records carry none),
// including those being written.
func (d *nodeDisk) clear() {
	d.curMu.Lock()
	d.curGone = d.writing
	d.curMu.Unlock()
	d.wb.Clear()
}

// closeDisk writes the blocks still queued (write-backs and
// write-throughs; a demoting slot is given back once written), stops the
// writers, writes the pool's blocks with WriteBackOnClose (within ctx) and
// closes the store; the node's calls have ended, the cache is still open
// (Close). A block accepted and not demoting yet (a reader still held it)
// is given back unwritten when its reader ends, counted dropped.
func (s *Server) closeDisk(ctx context.Context) {
	d := s.disk
	if d == nil {
		return
	}
	d.mu.Lock()
	d.closed = true
	if d.queue != nil {
		close(d.queue)
	}
	d.mu.Unlock()
	d.wb.Close()
	d.wg.Wait()
	if s.cfg.Disk.WriteBackOnClose {
		d.writeBackAtClose(ctx)
	}
	_ = d.store.Close()
}

// writeBackAtClose writes the pool's ready blocks that are not on disk
// yet (DiskConfig.WriteBackOnClose) from their slots, leased meanwhile
// (LeaseAll: ready blocks only, never a slot reserved for a store), with
// diskWriters goroutines; closeDisk calls it once the queued writes are
// done (tier/disk Store.PutAll). It starts no block once ctx has ended:
// those left that the store does not hold are counted (leftAtClose). A
// write the store refuses counts as a write error.
func (d *nodeDisk) writeBackAtClose(ctx context.Context) {
	slots, keys := d.cache.LeaseAll(nil, nil)
	if len(slots) == 0 {
		return
	}
	var before func(int)
	if d.beforePut != nil {
		before = func(i int) { d.beforePut(keys[i]) }
	}
	written, failed, left := d.store.PutAll(ctx, len(slots), diskWriters,
		func(i int) [16]byte { return keys[i] },
		func(i int) []byte { return d.slotBytes(slots[i]) }, // leased: its region is mapped
		before)
	d.atClose.Add(written)
	d.wb.WriteErrors.Add(failed)
	d.leftAtClose.Add(left)
	_ = d.cache.Unlease(slots) // LeaseAll's handles: only a bug fails
}

// promoteMissing (BeginLoad or Promote, with a disk tier) promotes the
// keys that the call's BeginLoad did not find in the pool (res) and the
// disk holds (key j's parent parent(j)), then loads them into res: found
// if promoted, missing if their read failed.
func (s *Server) promoteMissing(ns kvcache.Namespace, keys []kvcache.Key, parent func(j int) kvcache.Key, res []kvcache.LoadResult) {
	var pos []int
	for j, r := range res {
		if !r.Found && s.disk.has(keys[j]) {
			pos = append(pos, j)
		}
	}
	if len(pos) == 0 {
		return
	}
	s.promote(ns, keys, parent, pos)
	pk := make([]kvcache.Key, len(pos))
	for i, j := range pos {
		pk[i] = keys[j]
	}
	got, err := s.cache.BeginLoad(pk, blockIDs[:len(pk)], nil)
	if err != nil {
		return
	}
	for i, j := range pos {
		res[j] = got[i]
	}
}
