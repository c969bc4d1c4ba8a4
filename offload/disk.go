package offload

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/kvoffload/kvoffload/internal/tier/disk"
	"github.com/kvoffload/kvoffload/internal/tier/record"
	"github.com/kvoffload/kvoffload/internal/tiered"
	"github.com/kvoffload/kvoffload/kvcache"
)

// DiskConfig turns on the disk tier (Config.Disk) for blocks the pool
// evicts.
type DiskConfig struct {
	Dirs             []string   `json:"dirs"`           // required; a directory serves one engine at a time
	CapacityBytes    int64      `json:"capacity_bytes"` // required: the records files' total size
	Fsync            DiskFsync  `json:"fsync,omitempty"`
	Direct           DiskDirect `json:"direct,omitempty"`
	WriteBackBytes   int64      `json:"write_back_bytes,omitempty"`    // queued for writes; past it one is dropped
	AdmitAll         bool       `json:"admit_all,omitempty"`           // write every evicted block, not only
	AdmitAfter       int        `json:"admit_after,omitempty"`         // those whose key was seen this often (2, ≤ 255)
	WriteThrough     bool       `json:"write_through,omitempty"`       // also write each block once stored
	WriteBackOnClose bool       `json:"write_back_on_close,omitempty"` // Close writes the blocks not on disk yet
	RemoveRecords    []string   `json:"remove_records,omitempty"`      // other layouts' records files New deletes
}

// DiskFsync is DiskConfig.Fsync: when the disk tier flushes (default none).
type DiskFsync string

// DiskDirect is DiskConfig.Direct: whether to use O_DIRECT (default auto).
type DiskDirect string

// diskDefaults checks cfg.Disk and fills its defaults (on a copy: the
// caller's DiskConfig is not changed). The checks are internal/tiered's
// (DiskConfig.Check, with the admission sketch's 255), the Fsync and
// Direct values this package's.
//
// What DiskConfig's fields do, beyond their docs: each directory holds one
// records file per slot size (records-<slot bytes>.kvo, which `kvoffload
// info --disk` lists), locked for the engine's life, so a second engine on
// it is refused by New; another layout's file is kept unless named in
// RemoveRecords (naming this engine's own is ErrInvalidConfig).
// WriteBackBytes covers demoting slots (the pool holds that many blocks
// fewer meanwhile) and copies of slots a store needed at once; it is at
// least one block. Write-throughs are copied out of the slot when the store
// completes and, when dropped, still written back if evicted.
// WriteBackOnClose writes the most recently used blocks first with
// PolicyLRU, in slot order with TinyLFU (about 30 s for 64 GiB at 2 GB/s);
// a block the capacity cannot hold evicts the oldest records, as any write.
func diskDefaults(cfg *Config, slot int64) error {
	if cfg.Disk == nil {
		return nil
	}
	d := *cfg.Disk
	d.Dirs = append([]string(nil), d.Dirs...)
	d.RemoveRecords = append([]string(nil), d.RemoveRecords...)
	cfg.Disk = &d
	if d.Fsync == "" {
		d.Fsync = DiskFsyncNone
	}
	if d.Direct == "" {
		d.Direct = DiskDirectAuto
	}
	td, err := d.tiered().Check(255, func() error {
		_, _, err := diskModes(d)
		return err
	})
	if err != nil {
		if errors.Is(err, ErrInvalidConfig) {
			return err
		}
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	d.WriteBackBytes = max(td.WriteBackBytes, slot)
	d.AdmitAfter = td.AdmitAfter
	return nil
}

// tiered converts d (Fsync and Direct valid: diskDefaults checked them)
// to the tier's configuration; the write-throughs are copies
// (internal/tiered's QueueBlocks unused).
func (d DiskConfig) tiered() tiered.DiskConfig {
	fsync, direct, _ := diskModes(d)
	return tiered.DiskConfig{Dirs: d.Dirs, CapacityBytes: d.CapacityBytes, Fsync: fsync, Direct: direct,
		WriteBackBytes: d.WriteBackBytes, AdmitAll: d.AdmitAll, AdmitAfter: d.AdmitAfter, WriteThrough: d.WriteThrough,
		WriteBackOnClose: d.WriteBackOnClose, RemoveRecords: d.RemoveRecords}
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

// openDisk opens the disk tier of cfg (New; a tiered.Tier, its cache
// given by Start once it exists): the record payload is the slot, the
// fingerprint covers the namespace and the layout's geometry
// (recordFingerprint); the store's changes go to hub as MediumDisk events.
// A demoting slot is held against Trim while it is written, and its
// write-back ends with the reaper kicked; a Delete tombs its keys while
// write-backs are unfinished (writeback.Config.TombKeys). Evicted ahead
// of demand, a block goes to disk from its demoting slot; evicted by a
// store that needs the slot at once, from a copy: either way the evicting
// call never waits for the disk.
func openDisk(cfg Config, slot int64, hub *eventHub, h engineHooks, e *Engine) (*tiered.Tier, error) {
	dc := cfg.Disk
	fp, err := recordFingerprint(cfg)
	if err != nil {
		return nil, err
	}
	d, err := tiered.Open(tiered.Config{Disk: dc.tiered(), SlotBytes: slot, Fingerprint: fp, ZeroOnRelease: cfg.ZeroOnRelease,
		OnStore:  func(k [16]byte) { hub.onTier(EventStored, k, MediumDisk) },
		OnRemove: func(k [16]byte, _ bool) { hub.onTier(EventRemoved, k, MediumDisk) },
		Faults:   h.diskFaults, Bytes: e.slotBytes,
		Hold: func(s kvcache.Slot) { e.hold([]kvcache.Slot{s}) },
		Released: func(s kvcache.Slot) {
			e.unhold([]kvcache.Slot{s})
			e.kickReaper()
		},
		TombKeys: true, BeforePut: h.beforeDiskPut, BeforeGet: h.beforeDiskGet})
	if errors.Is(err, disk.ErrConfig) {
		return nil, fmt.Errorf("%w: Disk: %w", ErrInvalidConfig, err)
	}
	if err != nil {
		return nil, fmt.Errorf("offload: opening the disk tier (Disk.Dirs %q): %w", dc.Dirs, err)
	}
	return d, nil
}

// diskFaultFunc is internal/tier/disk's fault seam (Config.Faults), for tests
// (engineHooks.diskFaults).
type diskFaultFunc = func(op disk.FaultOp, dir string) error

// recordFingerprint is the fingerprint of the records cfg's engine writes to
// a lower tier (internal/tier/record; the disk and the cluster alike): a
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

// FlushDisk waits until every queued disk write is done, or ctx ends.
func (e *Engine) FlushDisk(ctx context.Context) error {
	if err := e.checkOpen("FlushDisk"); err != nil {
		return err
	}
	if e.disk == nil {
		return nil
	}
	return e.disk.Flush(ctx)
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
// chunk's reads run (tiered.Readers at once).
const diskChunk = tiered.Readers

// promoteChunks promotes the blocks of keys at pos (blocks the pool lacks
// and the disk holds) for a Load into blockIDs: it reserves host slots for
// them as a Store would (one chain, each key's parent the key before it),
// reads their records straight into the slots' pinned memory (tiered.Readers
// reads in flight, started in key order), and, chunk by chunk in order as soon as a chunk's
// reads are complete, makes the good blocks ready and takes reader holds
// on them (BeginLoad) and calls ready with the chunk's positions and
// BeginLoad's results (nil when it failed: every block missing). A record
// that vanished or fails its checks (internal/tier/record fails closed), or a slot
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
	go e.disk.Read(context.Background(), pkeys, mems, func(i int, good bool) {
		ok[i] = good
		reads[i/diskChunk].Done()
	})
	for c := range chunks {
		lo, hi := c*diskChunk, min((c+1)*diskChunk, len(pos))
		reads[c].Wait()
		var read []kvcache.Slot // the chunk's reserved slots, and their reads
		var rok []bool
		for i := lo; i < hi; i++ {
			if mems[i] != nil {
				read, rok = append(read, slots[i]), append(rok, ok[i])
			}
		}
		_, _ = tiered.Settle(e.cache, read, rok, errDiskMiss, func(good, bad int) {
			e.disk.Promoted(good, bad)
			e.unhold(read)
		})
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

// writeBackAtClose writes the pool's blocks that are not on disk yet to
// the disk tier (DiskConfig.WriteBackOnClose; tiered.Tier.WriteBackAtClose),
// from their slots, leased meanwhile; Close calls it once no call is in
// flight, before the cache and the tier close. No write starts once ctx
// has ended (the blocks left are not written, and not an error: Close's
// own wait reports ctx).
func (e *Engine) writeBackAtClose(ctx context.Context) error {
	if e.disk == nil || e.kc == nil {
		return nil
	}
	return e.disk.WriteBackAtClose(ctx)
}
