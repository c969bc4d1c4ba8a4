// Package tiered is the disk tier under a pool of host slots (a
// kvcache.Cache), shared by the embedded engine (offload, whose
// offload.DiskConfig converts to DiskConfig once) and the node
// (nodepool.ServerConfig.Disk). A Tier owns the internal/tier/disk Store, the
// write-back machine (internal/tier/disk/writeback) with its writers, the admission
// filter, the write-throughs, the reads of a promotion, the pool's
// write-back at close, and the tier's counters. Its owner keeps the block
// index (the cache), what a slot's bytes are (Config.Bytes), the
// reservation of slots for a promotion and what happens once a slot is
// given back (Config.Hold, Config.Released).
//
// What it promises:
//
//   - Admission: Saw counts uses of keys (stores, lookups) in a sketch;
//     Demote, the cache's Config.Demote, refuses an evicted key seen fewer
//     than DiskConfig.AdmitAfter times (NotAdmitted) unless AdmitAll (or
//     AdmitAfter 1). The sketch is the Tier's own (64 Ki saturating byte
//     counters, halved every 64 Ki uses: AdmitAfter up to 255) unless
//     Config.Sketch names another (the node's kvseen.Counter).
//   - Write-back: an admitted eviction goes to the write-back machine
//     (accepted within DiskConfig.WriteBackBytes of blocks waiting, else
//     dropped and counted), from its demoting slot (OnDemote: Hold first,
//     then a writer Puts it and gives it back through Cache.Demoted and
//     Released) or from a copy when the evicting store needs the slot.
//     Neither Demote nor OnDemote ever waits.
//   - Write-through (DiskConfig.WriteThrough): Through copies a ready
//     block's bytes now and a writer Puts the copy (the engine's); Ready
//     queues its key and one writer Puts it from its slot, leased
//     meanwhile, past QueueBlocks waiting dropped (the node's,
//     Config.ThroughFromSlot). A block on disk already is not written.
//   - Promotion: Has, Prefix and Get see the records and the write-backs
//     in flight (readable until written; Has and Prefix do no I/O); the owner
//     reserves slots as a store would, Read reads the records into them,
//     Readers at once, started in key order (none once its context ends),
//     and Settle makes the good ones ready and releases the others with a
//     miss, never a damaged block: a record that fails a check
//     (internal/tier/record) is a miss.
//   - LowWatermark is the free slots both pools keep by evicting ahead of
//     demand, so that write-backs go from demoting slots.
//   - Delete and Clear remove the records, also those being written (the
//     write-back in flight or the write-through in progress is marked gone
//     and its record deleted once written).
//   - Close: the write-throughs queued and the write-backs accepted are
//     written (every demoting slot is given back), the writers stop, with
//     atClose (the node's WriteBackOnClose) the pool's ready blocks not on
//     disk are written (WriteBackAtClose, bounded by its context; the
//     engine calls it itself, earlier, once its calls have ended), then
//     the Store closes. A second Close does nothing.
//
// Locks: the cache's lock is taken first (Demote, and Ready from the
// cache's OnIndex, run under it); under it a Tier takes its close lock
// (read), the sketch's lock and the writeback.Writer's locks, never a
// lock of its owner. Config.Bytes runs under the cache's lock and must not
// take a lock the cache's lock is taken under. The current write-through's
// lock (curMu) is a leaf. Hold runs in OnDemote, as the cache calls it;
// Released runs with no lock of the Tier or its Writer held.
package tiered
