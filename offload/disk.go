package offload

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/kvoffload/kvoffload/internal/tier/disk"
	"github.com/kvoffload/kvoffload/internal/tier/disk/writeback"
	"github.com/kvoffload/kvoffload/internal/tier/record"
	"github.com/kvoffload/kvoffload/kvcache"
)

// DiskConfig turns on the disk tier (Config.Disk): host blocks the policy
// evicts are written back to local disk (behind an admission filter), Lookup
// reports the prefix found there after the host prefix, and Load promotes
// such blocks back through host slots. It is plain data with JSON tags.
type DiskConfig struct {
	// Dirs are the directories records are kept in (one records file each,
	// locked for the engine's life: a second engine on one of them is
	// refused by New). Required.
	Dirs []string `json:"dirs"`
	// CapacityBytes bounds the records files' total size. Required.
	CapacityBytes int64 `json:"capacity_bytes"`
	// Fsync is DiskFsyncNone (default), DiskFsyncEach or DiskFsyncOnClose
	// (tier/disk's FsyncPolicy).
	Fsync DiskFsync `json:"fsync,omitempty"`
	// Direct is DiskDirectAuto (default: O_DIRECT where the file system
	// takes it), DiskDirectRequire or DiskDirectOff.
	Direct DiskDirect `json:"direct,omitempty"`
	// WriteBackBytes bounds the bytes of evicted blocks waiting for their
	// disk write: pool slots held "demoting" while they are written from
	// (the pool holds that many blocks fewer meanwhile), and copies of
	// slots a store needed at once (allocated as first needed). When the
	// bound is reached an eviction is not written back
	// (Stats.DiskDropped). Default DefaultWriteBackBytes; at least one
	// block.
	WriteBackBytes int64 `json:"write_back_bytes,omitempty"`
	// AdmitAll writes back every evicted block. By default only blocks
	// whose key was seen at least AdmitAfter times (stored or looked up)
	// are: a block used once is not worth a disk write.
	AdmitAll bool `json:"admit_all,omitempty"`
	// AdmitAfter is how many times a key must have been seen before its
	// evicted block is written back: default 2 (as Dynamo's G3), at most
	// 255; 1 admits every block. Ignored with AdmitAll.
	AdmitAfter int `json:"admit_after,omitempty"`
	// WriteThrough also writes every stored block to disk as soon as it is
	// ready, whatever the admission filter: a restart then finds every
	// block stored, not only those evicted before it (at a disk write per
	// block stored). The block is copied out of its slot when its store
	// completes (the slot is free to go at once) and written in the
	// background; past WriteBackBytes of writes queued it is dropped,
	// counted (Stats.DiskDropped), and still written back if evicted.
	WriteThrough bool `json:"write_through,omitempty"`
	// WriteBackOnClose has Close write every block in the pool that is
	// not on disk yet, whatever the admission filter, before it releases
	// the pool: a restart then finds what the pool held at the end, not
	// only what was evicted or written through. Close takes as long as
	// those blocks take at the disk's rate (a 64 GiB pool about 30 s at
	// 2 GB/s), bounded by CloseContext's context (the rest is not
	// written: the blocks go most recently used first with PolicyLRU,
	// in slot order with TinyLFU); a block the tier's capacity cannot
	// hold evicts its oldest records, as any write does. Counted in
	// Stats.DiskWrittenAtClose.
	WriteBackOnClose bool `json:"write_back_on_close,omitempty"`
	// RemoveRecords names records files of other layouts (other slot
	// sizes: records-<slot bytes>.kvo, as `kvoffload info --disk` lists
	// them) that New removes from every directory, giving their space
	// back. By default another layout's records file is kept beside this
	// engine's (another model's blocks, which its own engine finds again);
	// nothing on disk this engine did not write for its layout is deleted
	// unless named here. Naming this engine's own file is ErrInvalidConfig.
	RemoveRecords []string `json:"remove_records,omitempty"`
}

// DiskFsync is DiskConfig.Fsync: when the disk tier flushes its records.
type DiskFsync string

// DiskDirect is DiskConfig.Direct: whether the disk tier uses O_DIRECT.
type DiskDirect string

// DiskConfig.Fsync and DiskConfig.Direct values.
const (
	DiskFsyncNone     DiskFsync  = "none"
	DiskFsyncEach     DiskFsync  = "each"
	DiskFsyncOnClose  DiskFsync  = "on-close"
	DiskDirectAuto    DiskDirect = "auto"
	DiskDirectRequire DiskDirect = "require"
	DiskDirectOff     DiskDirect = "off"
)

// DefaultWriteBackBytes is DiskConfig.WriteBackBytes's default.
const DefaultWriteBackBytes int64 = 64 << 20

// diskWriters is the number of goroutines writing evicted blocks to disk.
const diskWriters = 2

// diskReaders bounds the disk reads one Load runs at once.
const diskReaders = 8

// diskDefaults checks cfg.Disk and fills its defaults (on a copy: the
// caller's DiskConfig is not changed).
func diskDefaults(cfg *Config, slot int64) error {
	if cfg.Disk == nil {
		return nil
	}
	d := *cfg.Disk
	d.Dirs = append([]string(nil), d.Dirs...)
	d.RemoveRecords = append([]string(nil), d.RemoveRecords...)
	cfg.Disk = &d
	if len(d.Dirs) == 0 {
		return fmt.Errorf("%w: Disk.Dirs is empty: name at least one directory", ErrInvalidConfig)
	}
	if d.CapacityBytes <= 0 {
		return fmt.Errorf("%w: Disk.CapacityBytes = %d, must be positive", ErrInvalidConfig, d.CapacityBytes)
	}
	if d.Fsync == "" {
		d.Fsync = DiskFsyncNone
	}
	if d.Direct == "" {
		d.Direct = DiskDirectAuto
	}
	if _, _, err := diskModes(d); err != nil {
		return err
	}
	switch {
	case d.WriteBackBytes == 0:
		d.WriteBackBytes = DefaultWriteBackBytes
	case d.WriteBackBytes < 0:
		return fmt.Errorf("%w: Disk.WriteBackBytes = %d, must not be negative", ErrInvalidConfig, d.WriteBackBytes)
	}
	d.WriteBackBytes = max(d.WriteBackBytes, slot)
	switch {
	case d.AdmitAfter == 0:
		d.AdmitAfter = 2
	case d.AdmitAfter < 0 || d.AdmitAfter > 255:
		return fmt.Errorf("%w: Disk.AdmitAfter = %d, want 1 to 255 (0: the default, 2)", ErrInvalidConfig, d.AdmitAfter)
	}
	return nil
}

func diskModes(d DiskConfig) (disk.FsyncPolicy, disk.DirectMode, error) {
	var f disk.FsyncPolicy
	var m disk.DirectMode
	switch d.Fsync {
	case DiskFsyncNone:
		f = disk.FsyncNone
	case DiskFsyncEach:
		f = disk.FsyncEach
	case DiskFsyncOnClose:
		f = disk.FsyncOnClose
	default:
		return 0, 0, fmt.Errorf("%w: Disk.Fsync %q: must be %q, %q or %q", ErrInvalidConfig, d.Fsync, DiskFsyncNone, DiskFsyncEach, DiskFsyncOnClose)
	}
	switch d.Direct {
	case DiskDirectAuto:
		m = disk.DirectAuto
	case DiskDirectRequire:
		m = disk.DirectRequire
	case DiskDirectOff:
		m = disk.DirectOff
	default:
		return 0, 0, fmt.Errorf("%w: Disk.Direct %q: must be %q, %q or %q", ErrInvalidConfig, d.Direct, DiskDirectAuto, DiskDirectRequire, DiskDirectOff)
	}
	return f, m, nil
}

// diskTier is the engine's disk tier: the store, the admission sketch and
// the write-back machine (tier/disk/writeback) with its writers.
//
// Write-back (demotion): the cache asks demote, under its lock, about each
// block its policy evicts; an admitted block not on disk yet, within
// maxBusy write-backs at once, is accepted (writeback.Writer.Demote).
// Evicted ahead of demand, its slot goes into the cache's "demoting" state
// and comes to onDemote, held against Trim: a writer Puts it straight from
// the slot's pinned memory and gives the slot back (Cache.Demoted, then
// unhold). Evicted by a store that needs the slot at once, the slot is
// freed at once: demote copies its bytes into a buffer first, which a
// writer Puts. Either way the evicting call never waits for the disk. A
// Delete tombs its keys while write-backs are unfinished
// (writeback.Config.TombKeys).
type diskTier struct {
	store        *disk.Store
	wb           *writeback.Writer
	admitAll     bool
	admitAfter   uint8 // DiskConfig.AdmitAfter
	writeThrough bool  // DiskConfig.WriteThrough

	seenMu   sync.Mutex
	seen     []uint8 // saturating use counts by key hash, halved every len(seen) additions
	seenAdds int

	hold func(kvcache.Slot) // the engine's: holds a slot against Trim while it is written

	readers int // a promotion's reads in flight (diskReaders; tests set 1)

	hits, misses, notAdmitted, throughs, atClose atomic.Int64
}

// openDisk opens the disk tier of cfg (New): the record payload is the
// slot, the fingerprint covers the namespace and the layout's geometry
// (recordFingerprint); the store's changes go to hub as MediumDisk events.
func openDisk(cfg Config, slot int64, hub *eventHub, h engineHooks, e *Engine) (*diskTier, error) {
	dc := cfg.Disk
	fsync, direct, err := diskModes(*dc)
	if err != nil {
		return nil, err
	}
	fp, err := recordFingerprint(cfg)
	if err != nil {
		return nil, err
	}
	st, err := disk.Open(disk.Config{Dirs: dc.Dirs, CapacityBytes: dc.CapacityBytes, RecordPayloadBytes: slot,
		Fingerprint: fp, Fsync: fsync, Direct: direct, ZeroOnRelease: cfg.ZeroOnRelease, RemoveRecords: dc.RemoveRecords,
		OnStore:  func(k [16]byte) { hub.onTier(EventStored, k, MediumDisk) },
		OnRemove: func(k [16]byte, _ bool) { hub.onTier(EventRemoved, k, MediumDisk) },
		Faults:   h.diskFaults})
	if errors.Is(err, disk.ErrConfig) {
		return nil, fmt.Errorf("%w: Disk: %w", ErrInvalidConfig, err)
	}
	if err != nil {
		return nil, fmt.Errorf("offload: opening the disk tier (Disk.Dirs %q): %w", dc.Dirs, err)
	}
	d := &diskTier{store: st, admitAll: dc.AdmitAll || dc.AdmitAfter <= 1, admitAfter: uint8(max(1, dc.AdmitAfter)),
		writeThrough: dc.WriteThrough, seen: make([]uint8, 1<<16),
		hold: func(s kvcache.Slot) { e.hold([]kvcache.Slot{s}) }, readers: diskReaders}
	d.wb = writeback.New(writeback.Config{Store: st, SlotBytes: int(slot), MaxBusy: int(dc.WriteBackBytes / slot),
		Writers: diskWriters, Bytes: e.slotBytes,
		Demoted: func(s kvcache.Slot) {
			_ = e.kc.Demoted([]kvcache.Slot{s}) // a slot onDemote was given: only a bug fails
			e.unhold([]kvcache.Slot{s})
			e.kickReaper()
		},
		BeforePut: h.beforeDiskPut, BeforeGet: h.beforeDiskGet, TombKeys: true})
	d.wb.Start()
	return d, nil
}

// diskFaultFunc is tier/disk's fault seam (Config.Faults), for tests
// (engineHooks.diskFaults).
type diskFaultFunc = func(op disk.FaultOp, dir string) error

// recordFingerprint is the fingerprint of the records cfg's engine writes to
// a lower tier (tier/record; the disk and the cluster alike): a
// hash of the namespace (which names the model and the dtype, DESIGN.md:
// the layout gives only the dtype's size), the layout kind, layers, KV
// heads, head dim, dtype bytes, tokens per block and the host format.
// Records of another fingerprint are misses. The KV heads are the model's
// (Layout.ModelKVHeads, or KVHeads), never a rank's, and nothing names the
// rank or the TP size: with a declared Layout.Order a record holds every
// head, head-major, and every TP size reads it.
func recordFingerprint(cfg Config) (uint64, error) {
	kind, err := layoutKind(cfg.Layout.Kind)
	if err != nil {
		return 0, err
	}
	l := cfg.Layout
	format := record.HostDeviceOrder
	if l.Order != "" {
		format = record.HostHeadMajor // the slot holds every head, whatever the rank
	}
	// The model's heads and the host format: never the rank or the TP
	// size, so that every TP size reads the records.
	return record.Fingerprint(record.Geometry{
		Namespace: []byte(cfg.Namespace), KVHeads: modelKVHeads(l), Layers: l.Layers, HeadDim: l.HeadDim,
		DTypeBytes: l.DTypeBytes, TokensPerBlock: l.TokensPerBlock, LayoutKind: uint8(kind),
		HostFormat: uint8(format),
	}), nil
}

// close writes back what is queued (giving the demoting slots back), then
// closes the store. The engine's calls have ended and the cache is closed
// (no eviction any more); the pool is unmapped after.
func (d *diskTier) close() error {
	if !d.wb.Close() {
		return nil
	}
	return d.store.Close()
}

// saw counts uses of keys (stores and lookups) for admission.
func (d *diskTier) saw(keys []Key) {
	if d.admitAll || len(keys) == 0 {
		return
	}
	d.seenMu.Lock()
	for _, k := range keys {
		b := binary.LittleEndian.Uint64(k[:8]) % uint64(len(d.seen))
		if d.seen[b] < 255 {
			d.seen[b]++
		}
		if d.seenAdds++; d.seenAdds >= len(d.seen) {
			d.seenAdds = 0
			for i := range d.seen {
				d.seen[i] >>= 1
			}
		}
	}
	d.seenMu.Unlock()
}

func (d *diskTier) admitted(k Key) bool {
	if d.admitAll {
		return true
	}
	d.seenMu.Lock()
	defer d.seenMu.Unlock()
	return d.seen[binary.LittleEndian.Uint64(k[:8])%uint64(len(d.seen))] >= d.admitAfter
}

// through writes a stored block (key k, mem its slot's bytes, which its
// caller holds until through returns) to disk (DiskConfig.WriteThrough):
// copied into a buffer now, Put by a writer. Dropped, counted, when
// maxBusy writes are accepted and unfinished; nothing when k is on disk.
// Never waits.
func (d *diskTier) through(k Key, mem []byte) {
	if d.wb.Copy(k, mem) {
		d.throughs.Add(1)
	}
}

// demote is the cache's Config.Demote, under its lock: a key the
// admission filter refuses is counted (notAdmitted); an admitted one goes
// to the write-back machine (writeback.Writer.Demote: accepted, or on
// disk already, or dropped; copied now when the evicting store needs the
// slot). It never waits.
func (d *diskTier) demote(s kvcache.Slot, k Key, needed bool) bool {
	if !d.admitted(k) {
		d.notAdmitted.Add(1)
		return false
	}
	return d.wb.Demote(s, k, needed)
}

// onDemote is the cache's Config.OnDemote: slot s, demoting, is held
// against Trim, then queued for a writer, which Puts it straight from the
// slot's memory and gives it back (Demoted, then unhold). Never blocks.
func (d *diskTier) onDemote(s kvcache.Slot, k Key) {
	d.hold(s)
	d.wb.OnDemote(s, k)
}

// delete removes keys from disk, and from the write-backs in flight
// (tombed first: deleted once written).
func (d *diskTier) delete(keys []Key) { d.wb.Delete(keys) }

// clearAll removes every record (records carry no namespace).
func (d *diskTier) clearAll() { d.wb.Clear() }

// prefix returns how many leading keys have a record on disk or a
// write-back in flight (memory only).
func (d *diskTier) prefix(keys []Key) int { return d.wb.Prefix(keys) }

// has reports whether key's block is on disk or being written there
// (readable meanwhile): memory only, never I/O.
func (d *diskTier) has(k Key) bool { return d.wb.Contains(k) }

// FlushDisk waits until every eviction queued for the disk tier has been
// written (or failed), or ctx ends. Without a disk tier it returns at once.
func (e *Engine) FlushDisk(ctx context.Context) error {
	if err := e.checkOpen("FlushDisk"); err != nil {
		return err
	}
	if e.disk == nil {
		return nil
	}
	return e.disk.wb.Flush(ctx)
}

// slotBytes returns slot s's bytes in the pool, nil when its region is
// gone.
func (e *Engine) slotBytes(s kvcache.Slot) []byte {
	mem, ok := e.slotMem.Load(s.Region)
	if !ok {
		return nil
	}
	return mem.([]byte)[s.Off : s.Off+uint64(e.slot)]
}

// errDiskMiss fails the stores of promoted blocks whose disk read missed.
var errDiskMiss = errors.New("offload: disk record missing or damaged")

// diskChunk is how many promoted blocks one part of a Load copies: a
// chunk's copy is submitted once its reads are complete, while the next
// chunk's reads run (diskReaders at once).
const diskChunk = diskReaders

// promoteChunks promotes the blocks of keys at pos (blocks the pool lacks
// and the disk holds) for a Load into blockIDs: it reserves host slots for
// them as a Store would (one chain, each key's parent the key before it),
// reads their records straight into the slots' pinned memory (diskReaders
// reads in flight, started in key order), and, chunk by chunk in order as soon as a chunk's
// reads are complete, makes the good blocks ready and takes reader holds
// on them (BeginLoad) and calls ready with the chunk's positions and
// BeginLoad's results (nil when it failed: every block missing). A record
// that vanished or fails its checks (tier/record fails closed), or a slot
// the pool could not give, stays missing, its slot released; blocks stored
// before are never touched. It returns after the last chunk's ready.
func (e *Engine) promoteChunks(keys []Key, blockIDs []int, pos []int, ready func(chunk []int, lres []kvcache.LoadResult)) {
	pkeys, parents, pids := make([]Key, len(pos)), make([]Key, len(pos)), make([]int, len(pos))
	for i, j := range pos {
		pkeys[i], pids[i] = keys[j], blockIDs[j]
		if j > 0 {
			parents[i] = keys[j-1]
		}
	}
	// Block ids name GPU blocks; a promotion's store copies none, so any
	// valid one does (0: a layout has at least one block).
	sres, err := e.beginStore(e.namespace(e.cfg.Namespace), kvcache.HeadRange{}, pkeys, make([]int, len(pkeys)), StoreOptions{Parents: parents})
	if err != nil {
		return // every block stays missing
	}
	slots := make([]kvcache.Slot, len(pos))
	mems := make([][]byte, len(pos))
	chunks := (len(pos) + diskChunk - 1) / diskChunk
	reads := make([]sync.WaitGroup, chunks)
	ok := make([]bool, len(pos))
	var lost, held []kvcache.Slot
	for i, r := range sres {
		if r.Outcome != kvcache.StoreWrite {
			continue // present meanwhile (another promotion), or refused
		}
		if mems[i] = e.slotBytes(r.Slot); mems[i] == nil {
			lost = append(lost, r.Slot) // its region is gone
			continue
		}
		slots[i] = r.Slot
		held = append(held, r.Slot)
		reads[i/diskChunk].Add(1)
	}
	if len(lost) > 0 {
		_ = e.cache.CompleteStore(lost, errDiskMiss)
	}
	e.hold(held)
	go func() {
		sem := make(chan struct{}, e.disk.readers)
		for i := range pos {
			if mems[i] == nil {
				continue
			}
			sem <- struct{}{}
			go func() {
				defer func() { <-sem }()
				ok[i] = e.disk.get(pkeys[i], mems[i])
				reads[i/diskChunk].Done()
			}()
		}
	}()
	for c := range chunks {
		lo, hi := c*diskChunk, min((c+1)*diskChunk, len(pos))
		reads[c].Wait()
		var good, bad []kvcache.Slot
		for i := lo; i < hi; i++ {
			switch {
			case mems[i] == nil:
			case ok[i]:
				good = append(good, slots[i])
			default:
				bad = append(bad, slots[i])
			}
		}
		e.disk.hits.Add(int64(len(good)))
		e.disk.misses.Add(int64(len(bad)))
		e.unhold(good)
		e.unhold(bad)
		if len(bad) > 0 {
			_ = e.cache.CompleteStore(bad, errDiskMiss)
		}
		if len(good) > 0 {
			_ = e.cache.CompleteStore(good, nil)
		}
		// Keys not reserved here may have been promoted by another call
		// meanwhile: BeginLoad finds them too.
		lres, err := e.cache.BeginLoad(pkeys[lo:hi], pids[lo:hi], nil)
		if err != nil {
			lres = nil
		}
		ready(pos[lo:hi], lres)
	}
	e.kickReaper()
}

// promoteNode is promoteChunks for an engine of Dial (ni), whose node's
// disk tier holds the blocks of keys at pos (beginLoadTiers said so): the
// node promotes them a chunk of diskChunk blocks a request
// (Client.Promote: slots reserved as promoteChunks reserves them, each
// key's parent the key before it, the records read into them on the node,
// the good ones made ready and their loads begun), and ready gets each
// chunk's positions and results in order, as promoteChunks gives them.
// The next chunk's request is sent as soon as a chunk's reply is in,
// before ready submits that chunk's copies: the node reads a chunk (its
// promoter serves a client's requests in order, in the background) while
// this engine submits the one before and the GPU copies it. A chunk the
// node could not serve (gone: ErrUnavailable) is all missing (ready gets
// nil) and no later chunk is asked for (missing too). Once ctx has ended
// no further chunk is asked for: those positions are returned, not
// promoted, for the caller to report cancelled (a chunk asked for before
// is given to ready, which ends its loads). It returns after the last
// chunk's ready; no request of it is left in flight.
func (e *Engine) promoteNode(ctx context.Context, ni *nodeIndex, keys []Key, blockIDs []int, pos []int, ready func(chunk []int, lres []kvcache.LoadResult)) (left []int) {
	type reply struct {
		lres []kvcache.LoadResult
		err  error
	}
	ask := func(lo, hi int) chan reply {
		ck, cp, ci := make([]Key, hi-lo), make([]Key, hi-lo), make([]int, hi-lo)
		for i, j := range pos[lo:hi] {
			ck[i], ci[i] = keys[j], blockIDs[j]
			if j > 0 {
				cp[i] = keys[j-1]
			}
		}
		ch := make(chan reply, 1)
		go func() {
			if e.hooks.beforeNodePromote != nil {
				e.hooks.beforeNodePromote(lo / diskChunk)
			}
			lres, err := ni.promote(ck, cp, ci)
			ch <- reply{lres, err}
		}()
		return ch
	}
	next := ask(0, min(diskChunk, len(pos)))
	for lo := 0; lo < len(pos); lo += diskChunk {
		hi := min(lo+diskChunk, len(pos))
		r := <-next
		if r.err != nil {
			e.stats.nodeDiskMisses.Add(int64(hi - lo))
		}
		for _, x := range r.lres {
			if x.Found {
				e.stats.nodeDiskHits.Add(1)
			} else {
				e.stats.nodeDiskMisses.Add(1)
			}
		}
		more := hi < len(pos) && r.err == nil && ctx.Err() == nil
		if more {
			next = ask(hi, min(hi+diskChunk, len(pos)))
		}
		ready(pos[lo:hi], r.lres) // nil when r.err: every block missing
		if !more {
			if r.err == nil && hi < len(pos) {
				left = pos[hi:]
			}
			break
		}
	}
	return left
}

// get reads key's block into mem, from its write-back in flight if there
// is one (Stats.DiskHitsWriting), else from its record (the test hook
// first); true when mem holds its verified block.
func (d *diskTier) get(k Key, mem []byte) bool { return d.wb.Get(k, mem) }

// writeBackAtClose writes the pool's blocks that are not on disk yet to
// the disk tier (DiskConfig.WriteBackOnClose), from their slots, leased
// meanwhile, with diskWriters goroutines; Close calls it once no call is
// in flight, before the cache and the tier close (tier/disk Store.PutAll).
// No write starts once ctx has ended (the blocks left are not written, and
// not an error: Close's own wait reports ctx). A write the store refuses
// counts as a write error.
func (e *Engine) writeBackAtClose(ctx context.Context) error {
	d := e.disk
	if d == nil || !e.cfg.Disk.WriteBackOnClose || e.kc == nil {
		return nil
	}
	slots, keys := e.kc.LeaseAll(nil, nil)
	if len(slots) == 0 {
		return nil
	}
	written, failed, _ := d.store.PutAll(ctx, len(slots), diskWriters,
		func(i int) [16]byte { return keys[i] },
		func(i int) []byte { return e.slotBytes(slots[i]) }, nil)
	d.atClose.Add(written)
	d.wb.WriteErrors.Add(failed)
	return e.kc.Unlease(slots)
}
