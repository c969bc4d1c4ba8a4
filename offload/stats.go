package offload

import (
	"math/bits"
	"sync/atomic"
	"time"
)

// Stats is a snapshot of counters since New and gauges, not atomic as a
// whole.
type Stats struct {
	Backend                    Backend            `json:"backend"`
	Lookups                    int64              `json:"lookups"`                      // Lookup calls
	LookupKeys                 int64              `json:"lookup_keys"`                  // keys asked about
	Hits                       int64              `json:"hits"`                         // keys found in the longest prefix
	Misses                     int64              `json:"misses"`                       // LookupKeys - Hits
	Outcomes                   [numOutcomes]int64 `json:"outcomes"`                     // blocks of every op by outcome
	Evictions                  int64              `json:"evictions"`                    // blocks evicted (policy, Trim)
	Deletes                    int64              `json:"deletes"`                      // blocks removed by Delete or Clear
	AdmissionRejections        int64              `json:"admission_rejections"`         // keys the policy declined
	Orphans                    int64              `json:"orphans"`                      // blocks evicted while a descendant stayed
	Partial                    int64              `json:"partial"`                      // head-range blocks still missing heads
	PartialExpired             int64              `json:"partial_expired"`              // reclaimed after Config.PartialTimeout
	StoreJoined                int64              `json:"store_joined"`                 // head-range stores into another rank's block
	PrefetchBackground         int64              `json:"prefetch_background"`          // PrefetchBestEffort calls run in the background
	PrefetchRefused            int64              `json:"prefetch_refused"`             // refused: too many running
	PrefetchBackgroundPromoted int64              `json:"prefetch_background_promoted"` // blocks they made ready
	Pool                       PoolStats          `json:"pool"`
	Copies                     CopyStats          `json:"copies"`
	Disk                       DiskStats          `json:"disk"`    // all 0 without Config.Disk
	Cluster                    ClusterStats       `json:"cluster"` // all 0 without Config.Cluster
	Node                       NodeStats          `json:"node"`    // all 0 for an engine of New
}

// PoolStats is the host pool: its memory, regions and their growth.
type PoolStats struct {
	Bytes             int64         `json:"bytes"`         // Config.PoolBytes
	OwnedBytes        int64         `json:"owned_bytes"`   // mapped and pinned now
	InUseBytes        int64         `json:"in_use_bytes"`  // slots holding a block
	StagingBytes      int64         `json:"staging_bytes"` // the staging region
	StagingUsed       int64         `json:"staging_used"`  // handed out by Staging
	BlockBytes        int64         `json:"block_bytes"`   // one block (one slot)
	SlotsTotal        int64         `json:"slots_total"`   // slots in pinned regions
	SlotsFree         int64         `json:"slots_free"`
	BlocksReady       int64         `json:"blocks_ready"`  // ready or leased blocks
	BlocksLeased      int64         `json:"blocks_leased"` // blocks with readers (leases, loads, cluster write-throughs)
	ZeroedSlots       int64         `json:"zeroed_slots"`  // zeroed on release (Config.ZeroOnRelease)
	Regions           int           `json:"regions"`       // regions pinned now
	RegionsTotal      int           `json:"regions_total"` // regions the pool is planned in
	PinCalls          int64         `json:"pin_calls"`
	UnpinCalls        int64         `json:"unpin_calls"`
	PinTime           time.Duration `json:"pin_time_ns"`         // mapping, prefaulting and pinning, summed over regions
	UnpinTime         time.Duration `json:"unpin_time_ns"`       // unpinning and unmapping
	FirstSlot         time.Duration `json:"first_slot_ns"`       // New called → first slot usable
	FullPool          time.Duration `json:"full_pool_ns"`        // New called → every region pinned (0 until then)
	Growth            GrowthSteps   `json:"growth"`              // time adding regions, by step
	GrowthPaused      bool          `json:"growth_paused"`       // PauseGrowth in effect
	GrowthTargetBytes int64         `json:"growth_target_bytes"` // what growth aims at (Trim lowers it, GrowTo raises it)
	GrowthError       string        `json:"growth_error"`        // why growth stopped early, if it did
	Trims             int64         `json:"trims"`
	TrimmedBytes      int64         `json:"trimmed_bytes"`
	TeardownErrors    int64         `json:"teardown_errors"`          // regions whose unpin or unmap failed
	TeardownError     string        `json:"teardown_error,omitempty"` // the last such error
}

// GrowthSteps is the time spent adding regions by step, summed over regions.
type GrowthSteps struct {
	Map        time.Duration `json:"map_ns"`         // mmap, advice, NUMA binding
	Prefault   time.Duration `json:"prefault_ns"`    // touching pages before pinning
	Pin        time.Duration `json:"pin_ns"`         // registration (CUDA) or mlock
	HostRanges time.Duration `json:"host_ranges_ns"` // handing the ranges to the copy scheduler
	Cache      time.Duration `json:"cache_ns"`       // carving the region into slots
}

// CopyStats is the GPU-pool copies; the fields from Bounced on are CUDA's.
type CopyStats struct {
	Store          DirectionStats `json:"store"` // device → host
	Load           DirectionStats `json:"load"`  // host → device
	InFlightBytes  int64          `json:"in_flight_bytes"`
	Calibration    string         `json:"calibration,omitempty"` // how the copy method was chosen ("" until calibrated)
	Bounced        int64          `json:"bounced"`               // CUDA copy batches bounced through device chunks
	Pitched        int64          `json:"pitched"`               // pitched DMAs of bounced copies
	BudgetWaits    int64          `json:"budget_waits"`          // copies that waited for device memory
	DeviceBytes    int64          `json:"device_bytes"`          // the copy layer's GPU memory now
	MaxDeviceBytes int64          `json:"max_device_bytes"`      // its bound in force
}

// DirectionStats counts the ops of one copy direction.
type DirectionStats struct {
	Ops     int64     `json:"ops"`     // ops finished
	Blocks  int64     `json:"blocks"`  // blocks copied
	Bytes   int64     `json:"bytes"`   // bytes copied
	Latency Histogram `json:"latency"` // op latency, call → done
}

// DiskStats is the disk tier (an engine of Dial: its own hits and misses).
type DiskStats struct {
	LookupHits     int64  `json:"lookup_hits"`      // keys Lookup found on disk (LookupResult.DiskHits)
	Hits           int64  `json:"hits"`             // blocks promoted from disk into the pool
	HitsWriting    int64  `json:"hits_writing"`     // Hits copied from a block still being written
	Misses         int64  `json:"misses"`           // indexed blocks whose read missed (reported missing)
	Writes         int64  `json:"writes"`           // evicted blocks written back
	WriteErrors    int64  `json:"write_errors"`     // write-backs refused or failed
	Dropped        int64  `json:"dropped"`          // not written: DiskConfig.WriteBackBytes in flight
	Copies         int64  `json:"copies"`           // write-backs copied out of the pool first
	NotAdmitted    int64  `json:"not_admitted"`     // evictions kept off disk (key seen once)
	WriteThroughs  int64  `json:"write_throughs"`   // stored blocks written through (DiskConfig.WriteThrough)
	WrittenAtClose int64  `json:"written_at_close"` // written by Close (DiskConfig.WriteBackOnClose)
	Records        int64  `json:"records"`          // records now
	Bytes          int64  `json:"bytes"`            // their payload bytes
	Capacity       int64  `json:"capacity"`         // records the tier can hold
	Mode           string `json:"mode,omitempty"`   // "direct", "buffered" or "mixed"; "off" with Error
	Corrupt        int64  `json:"corrupt"`          // records that failed a check when read
	TornAtOpen     int64  `json:"torn_at_open"`     // damaged records discarded at New
	StaleAtOpen    int64  `json:"stale_at_open"`    // records of another format or layout discarded at New
	IOErrors       int64  `json:"io_errors"`
	NoSpace        int64  `json:"no_space"`                 // ENOSPC or EDQUOT
	Evictions      int64  `json:"evictions"`                // records evicted for room
	Dirs           int    `json:"dirs"`                     // directories in use
	DirectDirs     int    `json:"direct_dirs"`              // of them with O_DIRECT
	ReadOnlyDirs   int    `json:"read_only_dirs"`           // serving, taking nothing new
	UnusableDirs   int    `json:"unusable_dirs"`            // left out at New
	Error          string `json:"error,omitempty"`          // why the tier is off (no directory usable)
	UnusableError  string `json:"unusable_error,omitempty"` // why UnusableDirs were left out
}

// ClusterStats is the cluster tier (Config.Cluster).
type ClusterStats struct {
	Configured        bool   `json:"configured"`
	Writes            int64  `json:"writes"`       // blocks written through and stored
	WriteBytes        int64  `json:"write_bytes"`  // their bytes
	WriteErrors       int64  `json:"write_errors"` // write-throughs that failed
	WriteOOM          int64  `json:"write_oom"`    // WriteErrors a full node refused (use an LRU or LFU maxmemory policy)
	Dropped           int64  `json:"dropped"`      // over ClusterConfig.MaxInFlightBytes
	Hits              int64  `json:"hits"`         // blocks Prefetch read (verified)
	HitBytes          int64  `json:"hit_bytes"`
	Misses            int64  `json:"misses"` // blocks Prefetch did not get, among them:
	Timeouts          int64  `json:"timeouts"`
	Corrupt           int64  `json:"corrupt"`
	Errors            int64  `json:"errors"`
	Available         bool   `json:"available"`          // connected; until then the tier retries in the background,
	Unavailable       int64  `json:"unavailable"`        // write-throughs and Prefetch keys skipped meanwhile,
	UnavailableWrites int64  `json:"unavailable_writes"` // the write-throughs among them,
	Error             string `json:"error,omitempty"`    // and why it is not connected
}

// NodeStats is an engine of Dial's node connection.
type NodeStats struct {
	Connections int64 `json:"connections"` // 1 after Dial, +1 per reconnection to a restarted node
}

// sum is the time of all steps (more than the wall time where they
// overlapped).
func (g GrowthSteps) sum() time.Duration { return g.Map + g.Prefault + g.Pin + g.HostRanges + g.Cache }

// growthSteps is the recording side of GrowthSteps.
type growthSteps struct {
	mapNanos, prefaultNanos, pinNanos, hostRangeNanos, cacheNanos atomic.Int64
}

func (g *growthSteps) snapshot() GrowthSteps {
	return GrowthSteps{Map: time.Duration(g.mapNanos.Load()), Prefault: time.Duration(g.prefaultNanos.Load()), Pin: time.Duration(g.pinNanos.Load()),
		HostRanges: time.Duration(g.hostRangeNanos.Load()), Cache: time.Duration(g.cacheNanos.Load())}
}

// Outcome returns the count of outcome oc.
func (s *Stats) Outcome(oc Outcome) int64 {
	if oc >= numOutcomes {
		return 0
	}
	return s.Outcomes[oc]
}

// histogramBuckets is the number of latency buckets: bucket i counts
// latencies in [2^(i-1), 2^i) microseconds (bucket 0: below 1 µs, the last:
// everything from 2^(histogramBuckets-2) µs ≈ 9 minutes up).
const histogramBuckets = 30

// Histogram counts latencies: Counts[i] those in [2^(i-1), 2^i) µs.
type Histogram struct {
	Counts [histogramBuckets]int64 `json:"counts"`
	Count  int64                   `json:"count"`
	Sum    time.Duration           `json:"sum_ns"`
}

// bucketUpper is the exclusive upper bound of bucket i (the last bucket has
// no bound and returns the largest duration).
func bucketUpper(i int) time.Duration {
	if i >= histogramBuckets-1 {
		return time.Duration(1<<63 - 1)
	}
	return time.Duration(1<<uint(i)) * time.Microsecond
}

// quantile returns an upper bound of the q-quantile (0 < q ≤ 1): the upper
// edge of the bucket holding it; 0 when the histogram is empty.
func (h Histogram) quantile(q float64) time.Duration {
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
			return bucketUpper(i)
		}
	}
	return bucketUpper(histogramBuckets - 1)
}

// mean is Sum/Count, 0 when empty.
func (h Histogram) mean() time.Duration {
	if h.Count == 0 {
		return 0
	}
	return h.Sum / time.Duration(h.Count)
}

// histogram is the lock-free recording side of Histogram.
type histogram struct {
	counts [histogramBuckets]atomic.Int64
	count  atomic.Int64
	sum    atomic.Int64
}

func bucketOf(d time.Duration) int {
	us := d.Microseconds()
	if us <= 0 {
		return 0
	}
	return min(bits.Len64(uint64(us)), histogramBuckets-1)
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

// direction is the recording side of DirectionStats.
type direction struct {
	ops, blocks, bytes atomic.Int64
	latency            histogram
}

func (d *direction) snapshot() DirectionStats {
	return DirectionStats{Ops: d.ops.Load(), Blocks: d.blocks.Load(), Bytes: d.bytes.Load(), Latency: d.latency.snapshot()}
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
	// promoted from disk for a Load, and those it could not (Stats.Disk.Hits,
	// Disk.Misses where the engine has no tier of its own).
	nodeDiskHits, nodeDiskMisses atomic.Int64
	clusterUnavailable           atomic.Int64 // Prefetch keys not asked of a cluster tier not connected
	// PrefetchBestEffort calls started, refused (too many running), and
	// the blocks they promoted.
	prefetchBackground, prefetchRefused, prefetchBackgroundPromoted atomic.Int64
	teardownErrors                                                  atomic.Int64
	inFlightBytes                                                   atomic.Int64
	store, load                                                     direction
}

// Stats returns a snapshot of the counters; cheap, also after Close.
func (e *Engine) Stats() Stats { return e.snapshot() }

func (e *Engine) snapshot() Stats {
	c := &e.stats
	s := Stats{Backend: e.backend,
		Lookups: c.lookups.Load(), LookupKeys: c.lookupKeys.Load(), Hits: c.hits.Load(), Deletes: c.deletes.Load(),
		Pool: PoolStats{Bytes: e.cfg.PoolBytes, BlockBytes: e.slot, ZeroedSlots: c.zeroed.Load(),
			PinCalls: c.pinCalls.Load(), UnpinCalls: c.unpinCalls.Load(),
			PinTime: time.Duration(c.pinNanos.Load()), UnpinTime: time.Duration(c.unpinNanos.Load()),
			FirstSlot: time.Duration(c.firstSlot.Load()), FullPool: time.Duration(c.fullPool.Load()), Growth: c.steps.snapshot(),
			Trims: c.trims.Load(), TrimmedBytes: c.trimmedBytes.Load()},
		Copies: CopyStats{InFlightBytes: c.inFlightBytes.Load(), Store: c.store.snapshot(), Load: c.load.snapshot()}}
	s.Misses = s.LookupKeys - s.Hits
	if d := e.dial; d != nil {
		if cl := d.client.Load(); cl != nil {
			s.Node.Connections = int64(cl.Info().Epoch)
		}
	}
	if c := e.calibration.Load(); c != nil {
		s.Copies.Calibration = *c
	}
	if e.cudaDev != nil {
		s.Copies.Bounced, s.Copies.Pitched = e.cudaDev.BounceCopies(), e.cudaDev.PitchedCopies()
		s.Copies.BudgetWaits = e.cudaDev.BudgetWaits()
		s.Copies.DeviceBytes, s.Copies.MaxDeviceBytes = e.cudaDev.DeviceBytes(), e.cudaDev.MaxDeviceBytes()
	}
	if e.diskErr != "" {
		s.Disk.Mode, s.Disk.Error, s.Disk.UnusableDirs = "off", e.diskErr, len(e.cfg.Disk.Dirs)
		s.Disk.UnusableError = e.diskErr
	}
	s.Disk.LookupHits = c.diskLookupHits.Load()                                 // the embedded tier's, or a node's
	s.Disk.Hits, s.Disk.Misses = c.nodeDiskHits.Load(), c.nodeDiskMisses.Load() // a node's; the embedded tier's below
	if d := e.disk; d != nil {
		ds := d.Store.Stats()
		s.Disk.Hits, s.Disk.Misses = d.Hits.Load(), d.Misses.Load()
		s.Disk.Writes, s.Disk.WriteErrors, s.Disk.Dropped = d.WB.Writes.Load(), d.WB.WriteErrors.Load(), d.WB.Dropped.Load()
		s.Disk.NotAdmitted, s.Disk.Corrupt, s.Disk.Copies = d.NotAdmitted.Load(), ds.Corrupt, d.WB.Copies.Load()
		s.Disk.WriteThroughs, s.Disk.WrittenAtClose = d.Throughs.Load(), d.AtClose.Load()
		s.Disk.HitsWriting = d.WB.Served.Load()
		s.Disk.Records, s.Disk.Bytes, s.Disk.Capacity, s.Disk.Mode = ds.Records, ds.Bytes, ds.CapacityRecords, ds.Mode.String()
		s.Disk.TornAtOpen, s.Disk.StaleAtOpen, s.Disk.IOErrors, s.Disk.NoSpace = ds.TornAtOpen, ds.StaleAtOpen, ds.IOErrors, ds.NoSpace
		s.Disk.Evictions, s.Disk.Dirs, s.Disk.DirectDirs = ds.Evictions, ds.Dirs, ds.DirectDirs
		s.Disk.ReadOnlyDirs, s.Disk.UnusableDirs = ds.ReadOnlyDirs, ds.UnusableDirs
		if err := d.Store.UnusableError(); err != nil {
			s.Disk.UnusableError = err.Error()
		}
	}
	if cl := e.cluster; cl != nil {
		cs := cl.Stats()
		s.Cluster.Configured = true
		s.Cluster.Writes, s.Cluster.WriteBytes, s.Cluster.WriteErrors, s.Cluster.WriteOOM = cs.Puts, cs.PutBytes, cs.PutErrors, cs.PutOOM
		s.Cluster.Dropped = cs.Dropped - cs.DroppedUnavailable
		s.Cluster.Hits, s.Cluster.HitBytes, s.Cluster.Misses = cs.Hits, cs.HitBytes, cs.Misses
		s.Cluster.Timeouts, s.Cluster.Corrupt, s.Cluster.Errors = cs.Timeouts, cs.Corrupt+cs.Stale, cs.Errors
		s.Cluster.Available, s.Cluster.Error = cs.Available, cs.ConnectError
		s.Cluster.UnavailableWrites = cs.DroppedUnavailable
		s.Cluster.Unavailable = cs.DroppedUnavailable + c.clusterUnavailable.Load()
	}
	s.PrefetchBackground, s.PrefetchRefused = c.prefetchBackground.Load(), c.prefetchRefused.Load()
	s.PrefetchBackgroundPromoted = c.prefetchBackgroundPromoted.Load()
	s.Pool.TeardownErrors = c.teardownErrors.Load()
	if m := e.teardownErr.Load(); m != nil {
		s.Pool.TeardownError = *m
	}
	for i := range s.Outcomes {
		s.Outcomes[i] = c.outcomes[i].Load()
	}
	e.memory.mu.Lock()
	s.Pool.OwnedBytes, s.Pool.Regions, s.Pool.StagingUsed = e.memory.owned, len(e.memory.regions), e.stage.used
	if e.stage.region != nil {
		s.Pool.StagingBytes = e.stage.region.r.Len()
	}
	e.memory.mu.Unlock()
	e.growth.mu.Lock()
	s.Pool.RegionsTotal, s.Pool.GrowthTargetBytes = len(e.growth.plan), e.growth.target
	s.Pool.GrowthPaused = e.growth.paused
	if e.growth.err != nil {
		s.Pool.GrowthError = e.growth.err.Error()
	}
	e.growth.mu.Unlock()
	if e.cache != nil {
		cs := e.cache.Stats()
		s.Pool.SlotsTotal, s.Pool.SlotsFree = int64(cs.Slots), int64(cs.Free)
		s.Pool.BlocksReady, s.Pool.BlocksLeased = int64(cs.Ready+cs.Leased), int64(cs.Leased)
		s.Pool.InUseBytes = int64(cs.Writing+cs.Ready+cs.Leased+cs.Releasing) * e.slot
		s.Evictions = int64(cs.Evicted + cs.Rejected + cs.Trimmed)
		s.AdmissionRejections = int64(cs.StoreRefusedAdmission + cs.Rejected)
		s.Orphans = int64(cs.Orphaned)
		s.Partial, s.PartialExpired, s.StoreJoined = int64(cs.Partial), int64(cs.PartialExpired), int64(cs.StoreJoined)
	}
	return s
}
