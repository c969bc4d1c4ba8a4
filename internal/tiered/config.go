package tiered

import (
	"errors"
	"fmt"

	"github.com/kvoffload/kvoffload/internal/tier/disk"
	"github.com/kvoffload/kvoffload/kvcache"
)

// DiskConfig is the disk tier under a pool (internal/tier/disk): the embedded
// engine's (offload.DiskConfig, converted) and the node's
// (nodepool.ServerConfig.Disk). The tier does the disk I/O, straight
// between its records and the pool's slots.
//
// By default the tier is written back: a block the pool's policy evicts
// is written to disk if its key passes the admission filter (seen at
// least AdmitAfter times, default 2: stores and lookups counted; AdmitAll
// takes every eviction) and is not on disk already, within WriteBackBytes
// of write-backs waiting (beyond it the eviction is dropped, counted
// Dropped). An accepted block leaves the index at once but stays readable
// until its write ends: a lookup counts it on disk, a load promotes it
// from the bytes it is written from. Evicted ahead of demand (the cache's
// low watermark), its slot goes into kvcache's "demoting" state (bytes
// intact, never handed to a store, its region not releasable) and a
// writer writes it straight from the slot, then frees it
// (kvcache.Cache.Demoted). Evicted by a store that needs its slot at once,
// it is copied out first (under the cache's lock; Copies) and written from
// the copy.
//
// WriteThrough also writes every block that becomes ready, whatever the
// admission filter: a restart then finds every block stored, not only
// those evicted. The engine copies the block out when its store completes
// (bounded by WriteBackBytes with the write-backs); the node writes it
// from its slot, held meanwhile by a reader hold the policy does not hear
// of, past QueueBlocks waiting dropped (Config.ThroughFromSlot).
// Evictions are still written back when their block is not on disk yet.
//
// WriteBackOnClose has the owner's Close write the pool's ready blocks
// that are not on disk yet (see the field).
type DiskConfig struct {
	// Dirs are the records' directories (one records file each), each
	// locked (flock) by the tier for its life. Required.
	Dirs []string
	// CapacityBytes bounds the records files' total size; the tier evicts
	// its oldest records beyond it. Required.
	CapacityBytes int64
	// Fsync and Direct are internal/tier/disk's (default: no fsync, O_DIRECT where
	// the file system takes it).
	Fsync  disk.FsyncPolicy
	Direct disk.DirectMode
	// WriteBackBytes bounds the bytes of evicted blocks waiting for their
	// disk write: demoting slots (the pool holds that many blocks fewer
	// meanwhile) and copies of slots a store needed at once (allocated as
	// first needed), and the engine's write-through copies. An eviction
	// past it is not written back (Dropped). Default
	// DefaultWriteBackBytes; at least one slot.
	WriteBackBytes int64
	// AdmitAll writes back every evicted block. By default only blocks
	// whose key was seen at least AdmitAfter times (stored or looked up)
	// are: a block used once is not worth a disk write.
	AdmitAll bool
	// AdmitAfter is how many times a key must have been seen before its
	// evicted block is written back: default 2 (as Dynamo's G3), at most
	// the sketch's saturation (Check's maxAdmitAfter: 255 for the Tier's
	// own sketch, kvseen.Max for the node's); 1 admits every
	// block. Ignored with AdmitAll.
	AdmitAfter int
	// WriteThrough also writes every block that becomes ready, whatever
	// the admission filter (see above).
	WriteThrough bool
	// QueueBlocks bounds the blocks waiting for their write-through from
	// their slots (Config.ThroughFromSlot); a block that finds the queue
	// full is not written through (Dropped). Default 256.
	QueueBlocks int
	// WriteBackOnClose has Close write every ready block in the pool that
	// is not on disk yet, whatever the admission filter, before the pool
	// is released: a restart then finds what the pool held at the end, not
	// only what was evicted or written through. It runs once the queued
	// write-backs and write-throughs are written (the node) or once no
	// call is in flight (the engine), over the ready blocks only (leased
	// meanwhile, kvcache.Cache.LeaseAll), from their slots, with Writers
	// goroutines, through the same store and record format as the
	// write-backs. It takes as long as those blocks take at the disk's
	// rate (a 64 GiB pool about 30 s at 2 GB/s), bounded by its context:
	// once it ends no further block is started and the blocks not on disk
	// that were not written are counted (LeftAtClose). The blocks go most
	// recently used first with the LRU policy, so a bound too short for
	// the pool keeps the hottest; with TinyLFU, in slot order. A block the
	// tier's capacity cannot hold evicts its oldest records, as any write
	// does. Counted in AtClose (not in the writes).
	WriteBackOnClose bool
	// RemoveRecords names records files of other layouts (internal/tier/disk's
	// Config.RemoveRecords) to remove from the directories when the tier
	// opens; by default another layout's records file is kept.
	RemoveRecords []string
}

// Defaults of DiskConfig.
const (
	DefaultWriteBackBytes int64 = 64 << 20
	DefaultQueueBlocks          = 256
	DefaultAdmitAfter           = 2
)

// Writers is the number of goroutines writing evicted blocks to disk (and
// the pool's blocks at close).
const Writers = 2

// Readers bounds the disk reads of one promotion in flight (Tier.Readers'
// default).
const Readers = 8

// LowWatermark is the free slots a pool of slots keeps by evicting ahead
// of demand (kvcache.Config.LowWatermark): 1/64 of them, at most 64, so
// that the blocks written back go from their demoting slots, not copied
// out under the cache's lock. The engine's pool always keeps it; the
// node's with a disk tier, unless configured.
func LowWatermark(slots int) int { return min(slots/64, 64) }

// Check checks d and returns it with its defaults filled (Dirs and
// RemoveRecords copied): Dirs and CapacityBytes required, then more (the
// owner's own checks; nil: none), then QueueBlocks and WriteBackBytes not
// negative, AdmitAfter 0 (default 2) to maxAdmitAfter. Its errors name the
// field (Disk.X) and the value, for the owner to wrap.
func (d DiskConfig) Check(maxAdmitAfter int, more func() error) (DiskConfig, error) {
	d.Dirs = append([]string(nil), d.Dirs...)
	d.RemoveRecords = append([]string(nil), d.RemoveRecords...)
	switch {
	case len(d.Dirs) == 0:
		return d, errors.New("Disk.Dirs is empty: name at least one directory")
	case d.CapacityBytes <= 0:
		return d, fmt.Errorf("Disk.CapacityBytes = %d, must be positive", d.CapacityBytes)
	}
	if more != nil {
		if err := more(); err != nil {
			return d, err
		}
	}
	switch {
	case d.QueueBlocks < 0:
		return d, fmt.Errorf("Disk.QueueBlocks = %d, must not be negative", d.QueueBlocks)
	case d.WriteBackBytes < 0:
		return d, fmt.Errorf("Disk.WriteBackBytes = %d, must not be negative", d.WriteBackBytes)
	case d.AdmitAfter < 0 || d.AdmitAfter > maxAdmitAfter:
		return d, fmt.Errorf("Disk.AdmitAfter = %d, want 1 to %d (0: the default, 2)", d.AdmitAfter, maxAdmitAfter)
	}
	if d.QueueBlocks == 0 {
		d.QueueBlocks = DefaultQueueBlocks
	}
	if d.WriteBackBytes == 0 {
		d.WriteBackBytes = DefaultWriteBackBytes
	}
	if d.AdmitAfter == 0 {
		d.AdmitAfter = DefaultAdmitAfter
	}
	return d, nil
}

// Sketch counts uses of keys for the admission filter
// (kvseen.Counter is one).
type Sketch interface {
	Add(keys []kvcache.Key)
	Count(k kvcache.Key) int
}

// Config describes a Tier (Open).
type Config struct {
	// Disk is the tier's configuration, checked (DiskConfig.Check).
	Disk DiskConfig
	// SlotBytes is a block's size: a slot's, a record's payload.
	SlotBytes int64
	// Fingerprint is the records' (internal/tier/record): records of another are
	// misses.
	Fingerprint uint64
	// ZeroOnRelease, OnStore, OnRemove and Faults are internal/tier/disk's.
	ZeroOnRelease bool
	OnStore       func(k [16]byte)
	OnRemove      func(k [16]byte, evicted bool)
	Faults        func(op disk.FaultOp, dir string) error
	// Bytes returns slot s's bytes, nil when its memory is gone. It runs
	// under the cache's lock (Demote) and in the writers: it must not take
	// a lock the cache's lock is taken under.
	Bytes func(s kvcache.Slot) []byte
	// Hold (may be nil) holds a demoting slot against its region's
	// release (OnDemote, before it is queued); Released undoes it once the
	// slot is given back.
	Hold func(s kvcache.Slot)
	// Released (may be nil) runs once a demoting slot was given back
	// (kvcache.Cache.Demoted) or a write-through's lease of slot s ended.
	Released func(s kvcache.Slot)
	// Sketch counts the uses of keys for admission; nil: the Tier's own
	// (AdmitAfter up to 255). Unused with AdmitAll or AdmitAfter 1.
	Sketch Sketch
	// ThroughFromSlot: WriteThrough writes a ready block from its slot,
	// queued by Ready (the node), not from a copy made by Through.
	ThroughFromSlot bool
	// TombKeys is writeback.Config.TombKeys.
	TombKeys bool
	// BeforePut and BeforeGet (tests) run before each write-back's or
	// write-through's Put and before each Get; BeforePutAtClose before
	// each Put of WriteBackAtClose.
	BeforePut, BeforeGet, BeforePutAtClose func(kvcache.Key)
}
