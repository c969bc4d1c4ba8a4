package offload

import (
	"math/bits"
	"sync/atomic"
	"time"
)

// Stats is a snapshot of the engine's counters, in the spirit of
// torch.cuda.host_memory_stats plus what an offload engine needs. Reading it
// is cheap (atomic loads, no lock held across the engine) and safe from any
// goroutine. Counters are monotonic since New; gauges (Bytes*, Slots*,
// Blocks*) are the state at the time of the call. The snapshot is not
// atomic as a whole: a counter read early may lag one read later by the
// ops completing in between.
type Stats struct {
	Backend Backend `json:"backend"`

	// Memory (bytes).
	PoolBytes     int64 `json:"pool_bytes"`      // configured pool size
	OwnedBytes    int64 `json:"owned_bytes"`     // mapped and pinned now (slots' regions)
	InUseBytes    int64 `json:"in_use_bytes"`    // slots holding a block (writing, ready, leased, releasing)
	InFlightBytes int64 `json:"in_flight_bytes"` // being copied, both directions
	StagingBytes  int64 `json:"staging_bytes"`   // the reserved staging region
	StagingUsed   int64 `json:"staging_used"`    // handed out by Staging

	// NodeConnections is, for an engine of Dial, the connections to its
	// node made so far: 1 after Dial, one more each time the engine
	// reconnected to a node that went away and came back (a node
	// restart). 0 for an engine of New.
	NodeConnections int64 `json:"node_connections,omitempty"`

	// Regions and pinning.
	Regions      int           `json:"regions"`       // regions pinned now
	RegionsTotal int           `json:"regions_total"` // regions the pool is planned in
	PinCalls     int64         `json:"pin_calls"`     // register/mlock calls
	UnpinCalls   int64         `json:"unpin_calls"`   // unregister/munlock calls
	PinTime      time.Duration `json:"pin_time_ns"`   // time spent mapping, prefaulting and pinning, summed over regions (overlapping in background growth)
	UnpinTime    time.Duration `json:"unpin_time_ns"` // time spent unpinning and unmapping
	FirstSlot    time.Duration `json:"first_slot_ns"` // New called → first slot usable
	FullPool     time.Duration `json:"full_pool_ns"`  // New called → every region pinned (0 until then)
	GrowthPaused bool          `json:"growth_paused"` // PauseGrowth in effect
	// GrowthTargetBytes is the pool size growth aims at: PoolBytes (or
	// MaxCachedBytes when smaller), lowered by Trim, raised by GrowTo.
	GrowthTargetBytes int64 `json:"growth_target_bytes"`
	// Growth splits the time spent adding the pool's regions (the first,
	// pinned by New, included; the staging region not) by step.
	Growth      GrowthSteps `json:"growth"`
	GrowthError string      `json:"growth_error"` // why background growth stopped early, if it did
	// TeardownErrors counts regions whose release (unpin, munlock, unmap)
	// failed, on every path (Trim, growth rollback, Close, which also
	// returns them); TeardownError is the last such error. A region whose
	// unpin failed twice stays mapped rather than be unmapped while pinned.
	TeardownErrors int64  `json:"teardown_errors"`
	TeardownError  string `json:"teardown_error,omitempty"`
	Trims          int64  `json:"trims"`         // Trim calls
	TrimmedBytes   int64  `json:"trimmed_bytes"` // bytes given back by Trim
	SlotsTotal     int64  `json:"slots_total"`   // slots in pinned regions
	SlotsFree      int64  `json:"slots_free"`    // free slots
	BlocksReady    int64  `json:"blocks_ready"`  // ready or leased blocks
	BlocksLeased   int64  `json:"blocks_leased"` // blocks with readers (Lookup leases, loads, write-throughs to the cluster not yet copied)
	BlockBytes     int64  `json:"block_bytes"`   // bytes of one block (one slot)
	// CopyCalibration says how the CUDA copy method is chosen: "" on the
	// host backend and until the background calibration is done (the
	// copier uses its uncalibrated rule meanwhile), then "calibrated in
	// ..." or the reason the uncalibrated rule stays. The growth thread
	// calibrates once growth has ended (before WaitGrown returns), where no
	// prefault competes for the CPUs, or earlier while growth is paused.
	CopyCalibration string `json:"copy_calibration,omitempty"`
	// BounceCopies counts the CUDA copy batches (one per store or load
	// batch the engine submits, not per block) of whole blocks bounced
	// through device chunks so that the DMA engines move them (stores
	// gathered on the device before one DMA per block, loads scattered
	// after it; see cudadev.CUDA); 0 on the host backend.
	BounceCopies int64 `json:"bounce_copies"`
	// PitchedCopies counts the pitched DMAs (one per device staging chunk)
	// of bounced copies whose host runs were rows of one length at one
	// pitch: a layer of consecutive slots in a per-layer load; 0 on the
	// host backend.
	PitchedCopies int64 `json:"pitched_copies"`
	// CopyBudgetWaits counts the times a copy waited for an earlier
	// batch's copies to finish so that its device memory (descriptor
	// tables, staging chunks; Config.MaxDeviceBytes) could be reused; 0 on
	// the host backend.
	CopyBudgetWaits int64 `json:"copy_budget_waits"`
	// DeviceBytes is the GPU memory the copy layer has allocated now
	// (descriptor tables, bounce chunks, the calibration buffer while it
	// runs), never above MaxDeviceBytes, the bound in force
	// (Config.MaxDeviceBytes or its default); both 0 on the host backend.
	DeviceBytes    int64 `json:"device_bytes"`
	MaxDeviceBytes int64 `json:"max_device_bytes"`

	// Lookups.
	Lookups    int64 `json:"lookups"`     // Lookup calls
	LookupKeys int64 `json:"lookup_keys"` // keys asked about
	Hits       int64 `json:"hits"`        // keys found in the longest prefix
	Misses     int64 `json:"misses"`      // LookupKeys - Hits

	// Outcomes by kind, over every op (Outcomes[OutcomeStored], ...).
	Outcomes [numOutcomes]int64 `json:"outcomes"`

	// Policy.
	Evictions           int64 `json:"evictions"`            // blocks evicted (policy, Trim, auto-trim)
	Deletes             int64 `json:"deletes"`              // blocks removed by Delete or Clear
	AdmissionRejections int64 `json:"admission_rejections"` // keys the policy declined
	Orphans             int64 `json:"orphans"`              // blocks evicted while a descendant stayed
	ZeroedSlots         int64 `json:"zeroed_slots"`         // slots zeroed on release (Config.ZeroOnRelease)

	// Tensor-parallel ranks storing head ranges (Layout.ModelKVHeads,
	// Engine.Rank).
	Partial        int64 `json:"partial"`         // blocks stored by head ranges still missing heads (never visible)
	PartialExpired int64 `json:"partial_expired"` // such blocks reclaimed after Config.PartialTimeout (a rank died or failed)
	StoreJoined    int64 `json:"store_joined"`    // head-range stores granted into a block another rank's store had reserved

	// The disk tier (Config.Disk); all 0 without one. An engine of Dial
	// whose node has a disk tier counts DiskLookupHits, DiskHits and
	// DiskMisses of its own calls (the node promotes).
	DiskLookupHits int64 `json:"disk_lookup_hits"` // keys Lookup found on disk after the host prefix (LookupResult.DiskHits)
	DiskHits       int64 `json:"disk_hits"`        // blocks Load read from disk into host slots (promoted)
	// DiskHitsWriting are the DiskHits (and Prefetch promotions) copied
	// from a block still being written to disk (its demoting slot, or its
	// copy) rather than read from its record: an evicted block is readable
	// from the moment its write-back is accepted.
	DiskHitsWriting int64 `json:"disk_hits_writing"`
	DiskMisses      int64 `json:"disk_misses"`       // blocks Load found indexed on disk whose read missed (vanished, damaged, I/O error): reported missing
	DiskWrites      int64 `json:"disk_writes"`       // evicted blocks written back to disk
	DiskWriteErrors int64 `json:"disk_write_errors"` // write-backs the store refused or failed (full, I/O error)
	DiskDropped     int64 `json:"disk_dropped"`      // admitted evictions not written back: DiskConfig.WriteBackBytes of write-backs were in flight
	DiskCopies      int64 `json:"disk_copies"`       // write-backs copied out of the pool first (a store needed the slot at once); the others go to disk from the slot
	DiskNotAdmitted int64 `json:"disk_not_admitted"` // evictions the admission filter kept off disk (key seen once)
	// DiskWriteThroughs are the stored blocks copied for a write-through
	// (DiskConfig.WriteThrough); each then counts in DiskWrites or
	// DiskWriteErrors like a write-back.
	DiskWriteThroughs int64 `json:"disk_write_throughs"`
	// DiskWrittenAtClose are the pool's blocks Close wrote to disk
	// (DiskConfig.WriteBackOnClose); not counted in DiskWrites.
	DiskWrittenAtClose int64  `json:"disk_written_at_close"`
	DiskCorrupt        int64  `json:"disk_corrupt"`        // records that failed a check when read (the store's count; each also a miss)
	DiskRecords        int64  `json:"disk_records"`        // records on disk now
	DiskBytes          int64  `json:"disk_bytes"`          // their payload bytes
	DiskCapacity       int64  `json:"disk_capacity"`       // records the disk tier can hold
	DiskMode           string `json:"disk_mode,omitempty"` // "direct", "buffered" or "mixed" (O_DIRECT in effect); "off" with DiskError
	// DiskError is why the configured disk tier is off: New found no
	// directory of Disk.Dirs usable (each one's error); the engine serves
	// from host memory, every directory counts in DiskUnusableDirs.
	DiskError string `json:"disk_error,omitempty"`
	// DiskUnusableError is why the directories counted in
	// DiskUnusableDirs were left out at New, each one's error, with the
	// tier on (the other directories serving) or off (then DiskError
	// says it too); "" when every directory is in use.
	DiskUnusableError string `json:"disk_unusable_error,omitempty"`
	// What the disk tier found at start and met since (tier/disk.Stats):
	// records it discarded at New (torn: a damaged header or a payload cut
	// off; stale: another format, fingerprint or size, or a second copy of
	// a key), failed reads and writes (NoSpace: those that were ENOSPC or
	// EDQUOT), records it evicted for room, and its directories: used,
	// with O_DIRECT in effect, read-only (serving, taking nothing new),
	// and left out at New (unusable).
	DiskTornAtOpen   int64 `json:"disk_torn_at_open"`
	DiskStaleAtOpen  int64 `json:"disk_stale_at_open"`
	DiskIOErrors     int64 `json:"disk_io_errors"`
	DiskNoSpace      int64 `json:"disk_no_space"`
	DiskEvictions    int64 `json:"disk_evictions"`
	DiskDirs         int   `json:"disk_dirs"`
	DiskDirectDirs   int   `json:"disk_direct_dirs"`
	DiskReadOnlyDirs int   `json:"disk_read_only_dirs"`
	DiskUnusableDirs int   `json:"disk_unusable_dirs"`

	// Prefetch with PrefetchBestEffort: calls started in the background,
	// calls refused (MaxBackgroundPrefetches were running), and the
	// blocks the background promotions made ready.
	PrefetchBackground         int64 `json:"prefetch_background"`
	PrefetchRefused            int64 `json:"prefetch_refused"`
	PrefetchBackgroundPromoted int64 `json:"prefetch_background_promoted"`

	// The cluster tier (Config.Cluster); all 0 without one.
	ClusterConfigured  bool  `json:"cluster_configured"`   // the engine has a cluster tier
	ClusterWrites      int64 `json:"cluster_writes"`       // blocks written through that the cluster stored
	ClusterWriteBytes  int64 `json:"cluster_write_bytes"`  // their bytes
	ClusterWriteErrors int64 `json:"cluster_write_errors"` // write-throughs the cluster failed (a node down, a timeout, OOM)
	// ClusterWriteOOM are the ClusterWriteErrors a node refused for want
	// of memory (maxmemory with noeviction: a full cluster; configure it
	// with an LRU or LFU eviction policy).
	ClusterWriteOOM int64 `json:"cluster_write_oom"`
	ClusterDropped  int64 `json:"cluster_dropped"`   // write-throughs dropped: over ClusterConfig.MaxInFlightBytes
	ClusterHits     int64 `json:"cluster_hits"`      // blocks Prefetch read from the cluster (verified)
	ClusterHitBytes int64 `json:"cluster_hit_bytes"` // their bytes
	// ClusterMisses are the blocks Prefetch asked the cluster for and did
	// not get (absent, damaged, stale, late, errors); ClusterTimeouts,
	// ClusterCorrupt (damaged or stale: another fingerprint or key) and
	// ClusterErrors (a node down, refused) are some of them.
	ClusterMisses   int64 `json:"cluster_misses"`
	ClusterTimeouts int64 `json:"cluster_timeouts"`
	ClusterCorrupt  int64 `json:"cluster_corrupt"`
	ClusterErrors   int64 `json:"cluster_errors"`
	// ClusterAvailable: the tier has connected (it connects in the
	// background when the cluster did not answer at New). While it has
	// not, write-throughs are not made and Prefetch does not ask it, each
	// block counted in ClusterUnavailable, and ClusterError says why the
	// last attempt failed.
	ClusterAvailable   bool  `json:"cluster_available"`
	ClusterUnavailable int64 `json:"cluster_unavailable"`
	// ClusterUnavailableWrites are the write-throughs among them (the rest
	// are Prefetch keys).
	ClusterUnavailableWrites int64  `json:"cluster_unavailable_writes"`
	ClusterError             string `json:"cluster_error,omitempty"`

	// Per direction.
	Store Direction `json:"store"`
	Load  Direction `json:"load"`
}

// GrowthSteps is the time spent adding pool regions, summed over regions,
// by step. Background growth runs the steps of neighbouring regions at the
// same time (region i+1 is mapped and prefaulted while region i registers,
// and region i-1 joins the cache meanwhile; see New), so the steps' sum may
// exceed FullPool, which is the wall time: each step's own sum never does.
// The first region (pinned by New) is included, the staging region not.
type GrowthSteps struct {
	Map        time.Duration `json:"map_ns"`         // mmap, advice and NUMA binding
	Prefault   time.Duration `json:"prefault_ns"`    // prefault of whole regions before pinning: every region but New's first on CUDA (whose prefault is inside Pin), every region on the host backend
	Pin        time.Duration `json:"pin_ns"`         // CUDA: registration (the first region: prefault and registration, pipelined by range); host: mlock and registration with the simulation
	HostRanges time.Duration `json:"host_ranges_ns"` // the scheduler's AddHostRange per registration range, and the gating tracker
	Cache      time.Duration `json:"cache_ns"`       // kvcache AddRegion: carving the region into free slots
}

// Sum is the time of all steps (more than the wall time where they
// overlapped).
func (g GrowthSteps) Sum() time.Duration { return g.Map + g.Prefault + g.Pin + g.HostRanges + g.Cache }

// growthSteps is the recording side of GrowthSteps.
type growthSteps struct {
	mapNanos, prefaultNanos, pinNanos, hostRangeNanos, cacheNanos atomic.Int64
}

func (g *growthSteps) snapshot() GrowthSteps {
	return GrowthSteps{Map: time.Duration(g.mapNanos.Load()), Prefault: time.Duration(g.prefaultNanos.Load()), Pin: time.Duration(g.pinNanos.Load()),
		HostRanges: time.Duration(g.hostRangeNanos.Load()), Cache: time.Duration(g.cacheNanos.Load())}
}

// Direction counts one copy direction.
type Direction struct {
	Ops     int64     `json:"ops"`     // ops finished
	Blocks  int64     `json:"blocks"`  // blocks copied
	Bytes   int64     `json:"bytes"`   // bytes copied
	Latency Histogram `json:"latency"` // op latency, call → done
}

// Outcome returns the count of outcome oc.
func (s *Stats) Outcome(oc Outcome) int64 {
	if oc >= numOutcomes {
		return 0
	}
	return s.Outcomes[oc]
}

// HistogramBuckets is the number of latency buckets: bucket i counts
// latencies in [2^(i-1), 2^i) microseconds (bucket 0: below 1 µs, the last:
// everything from 2^(HistogramBuckets-2) µs ≈ 9 minutes up).
const HistogramBuckets = 30

// Histogram is a fixed log2-scale latency histogram.
type Histogram struct {
	Counts [HistogramBuckets]int64 `json:"counts"`
	Count  int64                   `json:"count"`
	Sum    time.Duration           `json:"sum_ns"`
}

// BucketUpper is the exclusive upper bound of bucket i (the last bucket has
// no bound and returns the largest duration).
func BucketUpper(i int) time.Duration {
	if i >= HistogramBuckets-1 {
		return time.Duration(1<<63 - 1)
	}
	return time.Duration(1<<uint(i)) * time.Microsecond
}

// Quantile returns an upper bound of the q-quantile (0 < q ≤ 1): the upper
// edge of the bucket holding it; 0 when the histogram is empty.
func (h Histogram) Quantile(q float64) time.Duration {
	if h.Count == 0 {
		return 0
	}
	target := int64(q * float64(h.Count))
	if target < 1 {
		target = 1
	}
	var seen int64
	for i, c := range h.Counts {
		seen += c
		if seen >= target {
			return BucketUpper(i)
		}
	}
	return BucketUpper(HistogramBuckets - 1)
}

// Mean is Sum/Count, 0 when empty.
func (h Histogram) Mean() time.Duration {
	if h.Count == 0 {
		return 0
	}
	return h.Sum / time.Duration(h.Count)
}

// histogram is the lock-free recording side of Histogram.
type histogram struct {
	counts [HistogramBuckets]atomic.Int64
	count  atomic.Int64
	sum    atomic.Int64
}

func bucketOf(d time.Duration) int {
	us := d.Microseconds()
	if us <= 0 {
		return 0
	}
	return min(bits.Len64(uint64(us)), HistogramBuckets-1)
}

func (h *histogram) observe(d time.Duration) {
	h.counts[bucketOf(d)].Add(1)
	h.sum.Add(int64(d))
	h.count.Add(1)
}

func (h *histogram) snapshot() Histogram {
	var out Histogram
	for i := range h.counts {
		out.Counts[i] = h.counts[i].Load()
	}
	out.Sum = time.Duration(h.sum.Load())
	out.Count = h.count.Load()
	return out
}

// direction is the recording side of Direction.
type direction struct {
	ops, blocks, bytes atomic.Int64
	latency            histogram
}

func (d *direction) snapshot() Direction {
	return Direction{Ops: d.ops.Load(), Blocks: d.blocks.Load(), Bytes: d.bytes.Load(), Latency: d.latency.snapshot()}
}

// counters are the engine's monotonic counters, updated with atomics.
type counters struct {
	pinCalls, unpinCalls atomic.Int64
	pinNanos, unpinNanos atomic.Int64
	firstSlot, fullPool  atomic.Int64
	steps                growthSteps
	trims, trimmedBytes  atomic.Int64
	lookups, lookupKeys  atomic.Int64
	hits                 atomic.Int64
	outcomes             [numOutcomes]atomic.Int64
	deletes              atomic.Int64
	zeroed               atomic.Int64
	diskLookupHits       atomic.Int64
	// nodeDiskHits, nodeDiskMisses: a dialled engine's blocks its node
	// promoted from disk for a Load, and those it could not (Stats.DiskHits,
	// DiskMisses where the engine has no tier of its own).
	nodeDiskHits, nodeDiskMisses atomic.Int64
	clusterUnavailable           atomic.Int64 // Prefetch keys not asked of a cluster tier not connected
	// PrefetchBestEffort calls started, refused (too many running), and
	// the blocks they promoted.
	prefetchBackground, prefetchRefused, prefetchBackgroundPromoted atomic.Int64
	teardownErrors                                                  atomic.Int64
	inFlightBytes                                                   atomic.Int64
	store, load                                                     direction
}

// Stats returns a snapshot of the engine's counters; cheap, callable from
// any goroutine, also after Close.
func (e *Engine) Stats() Stats { return e.snapshot() }

func (e *Engine) snapshot() Stats {
	c := &e.stats
	s := Stats{Backend: e.backend, PoolBytes: e.cfg.PoolBytes, BlockBytes: e.slot,
		PinCalls: c.pinCalls.Load(), UnpinCalls: c.unpinCalls.Load(),
		PinTime: time.Duration(c.pinNanos.Load()), UnpinTime: time.Duration(c.unpinNanos.Load()),
		FirstSlot: time.Duration(c.firstSlot.Load()), FullPool: time.Duration(c.fullPool.Load()), Growth: c.steps.snapshot(),
		Trims: c.trims.Load(), TrimmedBytes: c.trimmedBytes.Load(),
		Lookups: c.lookups.Load(), LookupKeys: c.lookupKeys.Load(), Hits: c.hits.Load(),
		Deletes: c.deletes.Load(), ZeroedSlots: c.zeroed.Load(), InFlightBytes: c.inFlightBytes.Load(),
		Store: c.store.snapshot(), Load: c.load.snapshot()}
	s.Misses = s.LookupKeys - s.Hits
	if d := e.dial; d != nil {
		if cl := d.client.Load(); cl != nil {
			s.NodeConnections = int64(cl.Info().Epoch)
		}
	}
	if c := e.calibration.Load(); c != nil {
		s.CopyCalibration = *c
	}
	if e.cudaDev != nil {
		s.BounceCopies, s.PitchedCopies = e.cudaDev.BounceCopies(), e.cudaDev.PitchedCopies()
		s.CopyBudgetWaits = e.cudaDev.BudgetWaits()
		s.DeviceBytes, s.MaxDeviceBytes = e.cudaDev.DeviceBytes(), e.cudaDev.MaxDeviceBytes()
	}
	if e.diskErr != "" {
		s.DiskMode, s.DiskError, s.DiskUnusableDirs = "off", e.diskErr, len(e.cfg.Disk.Dirs)
		s.DiskUnusableError = e.diskErr
	}
	s.DiskLookupHits = c.diskLookupHits.Load()                                // the embedded tier's, or a node's
	s.DiskHits, s.DiskMisses = c.nodeDiskHits.Load(), c.nodeDiskMisses.Load() // a node's; the embedded tier's below
	if d := e.disk; d != nil {
		ds := d.Store.Stats()
		s.DiskHits, s.DiskMisses = d.Hits.Load(), d.Misses.Load()
		s.DiskWrites, s.DiskWriteErrors, s.DiskDropped = d.WB.Writes.Load(), d.WB.WriteErrors.Load(), d.WB.Dropped.Load()
		s.DiskNotAdmitted, s.DiskCorrupt, s.DiskCopies = d.NotAdmitted.Load(), ds.Corrupt, d.WB.Copies.Load()
		s.DiskWriteThroughs, s.DiskWrittenAtClose = d.Throughs.Load(), d.AtClose.Load()
		s.DiskHitsWriting = d.WB.Served.Load()
		s.DiskRecords, s.DiskBytes, s.DiskCapacity, s.DiskMode = ds.Records, ds.Bytes, ds.CapacityRecords, ds.Mode.String()
		s.DiskTornAtOpen, s.DiskStaleAtOpen, s.DiskIOErrors, s.DiskNoSpace = ds.TornAtOpen, ds.StaleAtOpen, ds.IOErrors, ds.NoSpace
		s.DiskEvictions, s.DiskDirs, s.DiskDirectDirs = ds.Evictions, ds.Dirs, ds.DirectDirs
		s.DiskReadOnlyDirs, s.DiskUnusableDirs = ds.ReadOnlyDirs, ds.UnusableDirs
		if err := d.Store.UnusableError(); err != nil {
			s.DiskUnusableError = err.Error()
		}
	}
	if cl := e.cluster; cl != nil {
		cs := cl.Stats()
		s.ClusterConfigured = true
		s.ClusterWrites, s.ClusterWriteBytes, s.ClusterWriteErrors, s.ClusterWriteOOM = cs.Puts, cs.PutBytes, cs.PutErrors, cs.PutOOM
		s.ClusterDropped = cs.Dropped - cs.DroppedUnavailable
		s.ClusterHits, s.ClusterHitBytes, s.ClusterMisses = cs.Hits, cs.HitBytes, cs.Misses
		s.ClusterTimeouts, s.ClusterCorrupt, s.ClusterErrors = cs.Timeouts, cs.Corrupt+cs.Stale, cs.Errors
		s.ClusterAvailable, s.ClusterError = cs.Available, cs.ConnectError
		s.ClusterUnavailableWrites = cs.DroppedUnavailable
		s.ClusterUnavailable = cs.DroppedUnavailable + c.clusterUnavailable.Load()
	}
	s.PrefetchBackground, s.PrefetchRefused = c.prefetchBackground.Load(), c.prefetchRefused.Load()
	s.PrefetchBackgroundPromoted = c.prefetchBackgroundPromoted.Load()
	s.TeardownErrors = c.teardownErrors.Load()
	if m := e.teardownErr.Load(); m != nil {
		s.TeardownError = *m
	}
	for i := range s.Outcomes {
		s.Outcomes[i] = c.outcomes[i].Load()
	}
	e.memory.mu.Lock()
	s.OwnedBytes, s.Regions, s.StagingUsed = e.memory.owned, len(e.memory.regions), e.stage.used
	if e.stage.region != nil {
		s.StagingBytes = e.stage.region.r.Len()
	}
	e.memory.mu.Unlock()
	e.growth.mu.Lock()
	s.RegionsTotal, s.GrowthTargetBytes = len(e.growth.plan), e.growth.target
	s.GrowthPaused = e.growth.paused
	if e.growth.err != nil {
		s.GrowthError = e.growth.err.Error()
	}
	e.growth.mu.Unlock()
	if e.cache != nil {
		cs := e.cache.Stats()
		s.SlotsTotal, s.SlotsFree = int64(cs.Slots), int64(cs.Free)
		s.BlocksReady, s.BlocksLeased = int64(cs.Ready+cs.Leased), int64(cs.Leased)
		s.InUseBytes = int64(cs.Writing+cs.Ready+cs.Leased+cs.Releasing) * e.slot
		s.Evictions = int64(cs.Evicted + cs.Rejected + cs.Trimmed)
		s.AdmissionRejections = int64(cs.StoreRefusedAdmission + cs.Rejected)
		s.Orphans = int64(cs.Orphaned)
		s.Partial, s.PartialExpired, s.StoreJoined = int64(cs.Partial), int64(cs.PartialExpired), int64(cs.StoreJoined)
	}
	return s
}
