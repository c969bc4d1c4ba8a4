package nodepool

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/kvoffload/kvoffload/tier/disk"
	"github.com/kvoffload/kvoffload/tier/record"
)

// DiskConfig puts a disk tier (tier/disk) under the node's pool
// (ServerConfig.Disk). The node does the disk I/O, straight between its
// records and the pool's slots; clients only copy between slots and their
// GPU, as without a disk tier.
//
// In the node the tier is write-through: every block that becomes ready
// in the pool (a client's commit) is written to disk from its slot, in the
// background, the slot held meanwhile by a reader hold (so it is not
// reused before its write ends). An evicted block is therefore on disk
// once its write finished (the embedded engine's write-back on eviction,
// with its admission filter, is not in the node yet). A Lookup reports,
// after the pool's hits, how many following keys the disk holds
// (LookupTiers); a BeginLoad of such keys promotes them first: the node
// reserves slots for them as a store would, reads their records into the
// slots (eight reads at once), makes the good ones ready and hands them
// out as found. A record that fails a check (tier/record) is a miss.
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
	// QueueBlocks bounds the blocks waiting for their write-through; a
	// block that finds the queue full is not written (Stats.DiskDropped).
	// Default 256.
	QueueBlocks int
}

// nodeDiskNamespace is the namespace in the fingerprint of the node's
// records: one node serves one slot layout (its first client's) for every
// namespace, and its keys name their namespace's prefixes themselves.
const nodeDiskNamespace = "kvoffload-node"

// diskReadsAtOnce bounds a promotion's disk reads in flight.
const diskReadsAtOnce = 8

// nodeDisk is the node's disk tier: the store, the write-through queue and
// its writer, and the counters.
type nodeDisk struct {
	store  *disk.Store
	queue  chan kvcache.Key
	mu     sync.RWMutex // closed; held (read) while queueing
	closed bool
	wg     sync.WaitGroup

	// The writer's block in progress, and whether a Delete or Clear came
	// for it meanwhile (its record is then deleted once written).
	curMu   sync.Mutex
	cur     kvcache.Key
	writing bool
	curGone bool

	lookupHits, hits, misses, writes, writeErrors, dropped atomic.Int64
}

// openDisk opens the disk tier for the cache's layout (newCache, s.mu
// held). An error leaves the node serving without it (Stats.DiskError).
func (s *Server) openDisk(layout *kvcache.Layout, kind kvcache.LayoutKind) error {
	dc := s.cfg.Disk
	g := layout.Geometry()
	fp := record.Fingerprint(record.Geometry{Namespace: []byte(nodeDiskNamespace), KVHeads: g.KVHeads, Layers: g.Layers,
		HeadDim: g.HeadDim, DTypeBytes: g.DTypeBytes, TokensPerBlock: g.TokensPerBlock, LayoutKind: uint8(kind),
		HostFormat: uint8(kvcache.HostDeviceOrder)})
	st, err := disk.Open(disk.Config{Dirs: dc.Dirs, CapacityBytes: dc.CapacityBytes, RecordPayloadBytes: int64(layout.SlotSize()),
		Fingerprint: fp, Fsync: dc.Fsync, Direct: dc.Direct})
	if err != nil {
		return fmt.Errorf("nodepool: opening the disk tier (Disk.Dirs %q): %w", dc.Dirs, err)
	}
	d := &nodeDisk{store: st, queue: make(chan kvcache.Key, dc.QueueBlocks)}
	d.wg.Add(1)
	go s.diskWriter(d)
	s.disk = d
	return nil
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
	case d.QueueBlocks == 0:
		d.QueueBlocks = 256
	}
	return &d, nil
}

// onReady queues a block that became ready for its write-through (from
// the cache's OnIndex, under its lock: never blocks).
func (d *nodeDisk) onReady(k kvcache.Key) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return
	}
	select {
	case d.queue <- k:
	default:
		d.dropped.Add(1)
	}
}

// diskWriter writes queued blocks to disk from their slots: each is held
// by a reader hold (a lease the policy does not hear of) while it is
// written, so its slot is not reused; a block already on disk, or gone from
// the pool meanwhile, is skipped.
func (s *Server) diskWriter(d *nodeDisk) {
	defer d.wg.Done()
	var slots []kvcache.Slot
	for k := range d.queue {
		if d.store.Contains(k) {
			continue
		}
		var n int
		n, slots = s.cache.LookupLeaseDeferred([]kvcache.Key{k}, slots[:0])
		if n == 0 {
			continue
		}
		if mem := s.slotBytes(slots[0]); len(mem) > 0 {
			d.curMu.Lock()
			d.cur, d.writing, d.curGone = k, true, false
			d.curMu.Unlock()
			err := d.store.Put(k, mem)
			d.curMu.Lock()
			gone := d.curGone
			d.writing = false
			d.curMu.Unlock()
			switch {
			case err != nil:
				d.writeErrors.Add(1)
			case gone:
				d.store.Delete(k)
			default:
				d.writes.Add(1)
			}
		}
		_ = s.cache.Unlease(slots[:1])
		s.reap()
	}
}

// slotBytes returns slot sl's bytes in the node's mapping of its region,
// nil when the region is gone. The caller holds the slot.
func (s *Server) slotBytes(sl kvcache.Slot) []byte {
	s.mu.Lock()
	rr := s.regions[uint32(sl.Region)]
	s.mu.Unlock()
	if rr == nil || sl.Off+s.slotSize > uint64(rr.r.Len()) {
		return nil
	}
	return rr.r.Bytes()[sl.Off : sl.Off+s.slotSize]
}

// diskPrefix returns how many leading keys the disk holds (memory only).
func (d *nodeDisk) diskPrefix(keys []kvcache.Key) int {
	for i, k := range keys {
		if !d.store.Contains(k) {
			return i
		}
	}
	return len(keys)
}

// promote brings the keys at pos (missing from the pool, held by the disk)
// into the pool for a BeginLoad: slots reserved as a store of namespace ns
// would (each key's parent the key before it in keys), records read
// straight into them, the good ones made ready. It returns nothing: the
// caller's BeginLoad finds what was promoted.
func (s *Server) promote(ns kvcache.Namespace, keys []kvcache.Key, pos []int) {
	d := s.disk
	c := s.cache
	var pkeys []kvcache.Key
	for _, j := range pos {
		pkeys = append(pkeys, keys[j])
	}
	// One BeginStore per run of consecutive positions (one chain each).
	var slots []kvcache.Slot
	var skeys []kvcache.Key
	for i := 0; i < len(pos); {
		j := i + 1
		for j < len(pos) && pos[j] == pos[j-1]+1 {
			j++
		}
		var parent kvcache.Key
		if pos[i] > 0 {
			parent = keys[pos[i]-1]
		}
		res, err := c.BeginStore(kvcache.StoreRequest{Namespace: ns, Parent: parent, Keys: pkeys[i:j], BlockIDs: blockIDs[:j-i]}, nil)
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
		mem := s.slotBytes(slots[i])
		if len(mem) == 0 {
			continue
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			found, err := d.store.Get(skeys[i], mem)
			ok[i] = found && err == nil
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

// delete removes keys' records (Delete), including one being written.
func (d *nodeDisk) delete(keys []kvcache.Key) {
	d.curMu.Lock()
	for _, k := range keys {
		if d.writing && k == d.cur {
			d.curGone = true
		}
	}
	d.curMu.Unlock()
	for _, k := range keys {
		d.store.Delete(k)
	}
}

// clear removes every record (Clear of any namespace: records carry none),
// including one being written.
func (d *nodeDisk) clear() {
	d.curMu.Lock()
	d.curGone = d.writing
	d.curMu.Unlock()
	d.store.Clear()
}

// closeDisk writes the blocks still queued, stops the writer and closes
// the store; the node's calls have ended, the cache is still open (Close).
func (s *Server) closeDisk() {
	d := s.disk
	if d == nil {
		return
	}
	d.mu.Lock()
	d.closed = true
	close(d.queue)
	d.mu.Unlock()
	d.wg.Wait()
	_ = d.store.Close()
}

// promoteMissing (BeginLoad, with a disk tier) promotes the keys that
// BeginLoad did not find in the pool and the disk holds, then loads them
// into the call's results (p.loadRes): found if promoted, missing if their
// read failed.
func (p *peer) promoteMissing(keys []kvcache.Key, ns kvcache.Namespace) {
	s := p.s
	var pos []int
	for j, r := range p.loadRes {
		if !r.Found && s.disk.store.Contains(keys[j]) {
			pos = append(pos, j)
		}
	}
	if len(pos) == 0 {
		return
	}
	s.promote(ns, keys, pos)
	pk := make([]kvcache.Key, len(pos))
	for i, j := range pos {
		pk[i] = keys[j]
	}
	res, err := s.cache.BeginLoad(pk, blockIDs[:len(pk)], nil)
	if err != nil {
		return
	}
	for i, j := range pos {
		p.loadRes[j] = res[i]
	}
}
