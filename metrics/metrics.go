// Package metrics exports an offload.Engine's Stats as Prometheus metrics.
//
// It is a view: a Collector reads Engine.Stats on every scrape and turns
// each field into a metric, so the metrics and Stats never disagree (Stats
// stays the source). The offload package does not import this one: a Go
// program that does not want client_golang does not get it.
//
// Names follow vLLM's KV-offload metrics (vLLM v0.27.0:
// CPUOffloadingMetrics in vllm/v1/kv_offload/cpu, and the offloading
// connector's kv_offload_total_bytes / kv_offload_total_time by
// transfer_type) with vLLM's "vllm:kv_offload_" prefix replaced by
// "kvoffload_"; metrics vLLM has no counterpart for (pool, growth) use the
// same prefix. The README lists the correspondence.
//
// NodeRegistry exports a node's (`kvoffload serve`) state the same way,
// as kvoffload_node_* series read from NodeStats on every scrape.
package metrics

import (
	"io"
	"net/http"
	"time"

	"github.com/kvoffload/kvoffload/offload"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/common/expfmt"
)

// Source is what the Collector reads: *offload.Engine.
type Source interface {
	Stats() offload.Stats
}

// Transfer types, spelled as vLLM's offloading connector labels them.
const (
	GPUToCPU = "GPU_to_CPU" // stores
	CPUToGPU = "CPU_to_GPU" // loads
)

// Tier labels: the host pool, the disk tier (offload.Config.Disk) and the
// cluster tier (offload.Config.Cluster).
const (
	TierCPU     = "cpu"
	TierDisk    = "disk"
	TierCluster = "cluster"
)

// Collector is a prometheus.Collector over one engine's Stats.
type Collector struct {
	src    Source
	labels prometheus.Labels
	d      descs
}

type descs struct {
	lookups, blockLookups, hits, misses                      *prometheus.Desc
	outcomes, skipped, evictions, deletes, admission         *prometheus.Desc
	blocks, bytes, ops, latency                              *prometheus.Desc
	usage, poolBytes, ownedBytes, inUse, inFlight            *prometheus.Desc
	stagingBytes, slots, ready, leased, blockBytes           *prometheus.Desc
	growthTarget, growthPaused, growthDone, growthError      *prometheus.Desc
	regions, trims, trimmed                                  *prometheus.Desc
	tierReads, tierWrites, tierCorrupt, tierRecords          *prometheus.Desc
	tierBytes, tierCapacity, tierMode                        *prometheus.Desc
	tierFailures, tierTransferred, tierAvailable, tierCopies *prometheus.Desc
	tierDiscarded, tierIOErrors, tierEvictions, tierDirs     *prometheus.Desc
}

// New returns a Collector of src's Stats; constLabels (may be nil) are added
// to every metric (an engine name, a model).
func New(src Source, constLabels prometheus.Labels) *Collector {
	c := &Collector{src: src, labels: constLabels}
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc("kvoffload_"+name, help, labels, constLabels)
	}
	c.d = descs{
		lookups:         d("lookups_total", "Lookup calls.", "tier"),
		blockLookups:    d("cpu_block_lookup_total", "Blocks looked up (keys asked about).", "tier"),
		hits:            d("cpu_block_hit_total", "Blocks found: the longest ready prefix of each lookup.", "tier"),
		misses:          d("cpu_block_miss_total", "Blocks looked up and not found.", "tier"),
		outcomes:        d("block_outcomes_total", "Final outcome of every block of every Store and Load.", "outcome"),
		skipped:         d("stores_skipped_total", "Blocks a Store did not copy, by reason (already present, refused full/busy/admission, cancelled, failed).", "reason"),
		evictions:       d("block_eviction_total", "Blocks evicted (policy, Trim, automatic trim).", "tier"),
		deletes:         d("block_deletes_total", "Blocks removed by Delete or Clear.", "tier"),
		admission:       d("admission_rejections_total", "Keys the admission policy declined.", "tier"),
		blocks:          d("total_blocks_total", "Blocks copied.", "transfer_type"),
		bytes:           d("total_bytes_total", "Bytes copied.", "transfer_type"),
		ops:             d("transfer_ops_total", "Store or Load ops finished.", "transfer_type"),
		latency:         d("transfer_latency_seconds", "Op latency, call to done.", "transfer_type"),
		usage:           d("cpu_cache_usage_perc", "Fraction of the pinned pool holding blocks (in-use bytes over owned bytes).", "tier"),
		poolBytes:       d("pool_capacity_bytes", "Configured pool size.", "tier"),
		ownedBytes:      d("pool_owned_bytes", "Pool bytes mapped and pinned now.", "tier"),
		inUse:           d("pool_in_use_bytes", "Pool bytes holding a block (writing, ready, leased, releasing).", "tier"),
		inFlight:        d("pool_in_flight_bytes", "Bytes being copied, both directions.", "tier"),
		stagingBytes:    d("staging_bytes", "Staging region: reserved or used.", "state"),
		slots:           d("pool_slots", "Slots of pinned regions: total or free.", "state"),
		ready:           d("blocks_ready", "Ready or leased blocks.", "tier"),
		leased:          d("blocks_leased", "Blocks with readers.", "tier"),
		blockBytes:      d("block_bytes", "Bytes of one block (one slot).", "tier"),
		growthTarget:    d("growth_target_bytes", "Pool size background growth aims at.", "tier"),
		growthPaused:    d("growth_paused", "1 while PauseGrowth is in effect.", "tier"),
		growthDone:      d("growth_complete", "1 once every planned region is pinned.", "tier"),
		growthError:     d("growth_error", "1 when background growth stopped on an error.", "tier"),
		regions:         d("pool_regions", "Pool regions: pinned now or planned.", "state"),
		trims:           d("trims_total", "Trim calls.", "tier"),
		trimmed:         d("trimmed_bytes_total", "Bytes given back by Trim.", "tier"),
		tierReads:       d("tier_reads_total", "Blocks read from a lower tier into host slots (disk: by Load and Prefetch; cluster: by Prefetch): hit (promoted) or miss (absent, vanished, damaged, late, I/O error).", "tier", "result"),
		tierWrites:      d("tier_writes_total", "Host blocks sent to a lower tier (disk: evicted blocks written back; cluster: stored blocks written through): written, error (refused or failed), dropped (no buffer free, or over the bytes in flight), unavailable (cluster not connected).", "tier", "result"),
		tierCorrupt:     d("tier_corrupt_total", "Lower-tier records that failed a check when read (each also a read miss).", "tier"),
		tierRecords:     d("tier_records", "Records a lower tier holds.", "tier"),
		tierBytes:       d("tier_bytes", "Payload bytes of those records.", "tier"),
		tierCapacity:    d("tier_capacity_records", "Records a lower tier can hold.", "tier"),
		tierMode:        d("tier_io_mode", "1 for the I/O mode in effect (direct, buffered or mixed O_DIRECT).", "tier", "mode"),
		tierFailures:    d("tier_read_failures_total", "Lower-tier read misses by cause: timeout (no answer in time), error (a node down, refused), unavailable (blocks not asked: the tier not connected).", "tier", "reason"),
		tierTransferred: d("tier_transfer_bytes_total", "Payload bytes moved to (written) and from (read) a lower tier.", "tier", "direction"),
		tierAvailable:   d("tier_available", "1 while a lower tier is connected and in use, 0 while it is not (the cluster tier reconnecting).", "tier"),
		tierDiscarded:   d("tier_discarded_at_open_total", "Disk records discarded when the engine started: torn (a damaged header, a payload cut off by a crash) or stale (another format, fingerprint or size, a second copy of a key).", "tier", "reason"),
		tierIOErrors:    d("tier_io_errors_total", "Failed disk reads and writes by cause: no_space (ENOSPC, EDQUOT) or io (any other).", "tier", "reason"),
		tierEvictions:   d("tier_evictions_total", "Records the disk tier evicted (least recently used) to make room.", "tier"),
		tierDirs:        d("tier_directories", "The disk tier's directories by state: read_write, read_only (serving its records, taking none), unusable (left out at start).", "tier", "state"),
		tierCopies:      d("tier_write_copies_total", "Blocks copied out of their slot before being written to a lower tier (disk: the blocks a store evicted for itself; the others are written from their slot).", "tier"),
	}
	return c
}

func (c *Collector) all() []*prometheus.Desc {
	d := &c.d
	return []*prometheus.Desc{d.lookups, d.blockLookups, d.hits, d.misses, d.outcomes, d.skipped, d.evictions, d.deletes,
		d.admission, d.blocks, d.bytes, d.ops, d.latency, d.usage, d.poolBytes, d.ownedBytes, d.inUse, d.inFlight,
		d.stagingBytes, d.slots, d.ready, d.leased, d.blockBytes, d.growthTarget, d.growthPaused, d.growthDone,
		d.growthError, d.regions, d.trims, d.trimmed, d.tierReads, d.tierWrites, d.tierCorrupt, d.tierRecords,
		d.tierBytes, d.tierCapacity, d.tierMode, d.tierFailures, d.tierTransferred, d.tierAvailable, d.tierCopies,
		d.tierDiscarded, d.tierIOErrors, d.tierEvictions, d.tierDirs}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.all() {
		ch <- d
	}
}

// skippedReasons are the outcomes of a Store's blocks that were not copied.
var skippedReasons = []offload.Outcome{offload.OutcomeAlreadyPresent, offload.OutcomeRefusedFull, offload.OutcomeRefusedBusy,
	offload.OutcomeRefusedAdmission}

// Collect implements prometheus.Collector: one Stats snapshot per scrape.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	s := c.src.Stats()
	d := &c.d
	counter := func(desc *prometheus.Desc, v int64, label string) {
		ch <- prometheus.MustNewConstMetric(desc, prometheus.CounterValue, float64(v), label)
	}
	gauge := func(desc *prometheus.Desc, v float64, label string) {
		ch <- prometheus.MustNewConstMetric(desc, prometheus.GaugeValue, v, label)
	}
	b := func(x bool) float64 {
		if x {
			return 1
		}
		return 0
	}
	counter(d.lookups, s.Lookups, TierCPU)
	counter(d.blockLookups, s.LookupKeys, TierCPU)
	counter(d.hits, s.Hits, TierCPU)
	counter(d.misses, s.Misses, TierCPU)
	for i, v := range s.Outcomes {
		if oc := offload.Outcome(i); oc != offload.OutcomePending {
			counter(d.outcomes, v, oc.String())
		}
	}
	for _, oc := range skippedReasons {
		counter(d.skipped, s.Outcome(oc), oc.String())
	}
	counter(d.evictions, s.Evictions, TierCPU)
	counter(d.deletes, s.Deletes, TierCPU)
	counter(d.admission, s.AdmissionRejections, TierCPU)
	for _, dir := range []struct {
		name string
		d    offload.DirectionStats
	}{{GPUToCPU, s.Copies.Store}, {CPUToGPU, s.Copies.Load}} {
		counter(d.blocks, dir.d.Blocks, dir.name)
		counter(d.bytes, dir.d.Bytes, dir.name)
		counter(d.ops, dir.d.Ops, dir.name)
		ch <- histogram(d.latency, dir.d.Latency, dir.name)
	}
	usage := 0.0
	if s.Pool.OwnedBytes > 0 {
		usage = float64(s.Pool.InUseBytes) / float64(s.Pool.OwnedBytes)
	}
	gauge(d.usage, usage, TierCPU)
	gauge(d.poolBytes, float64(s.Pool.Bytes), TierCPU)
	gauge(d.ownedBytes, float64(s.Pool.OwnedBytes), TierCPU)
	gauge(d.inUse, float64(s.Pool.InUseBytes), TierCPU)
	gauge(d.inFlight, float64(s.Copies.InFlightBytes), TierCPU)
	gauge(d.stagingBytes, float64(s.Pool.StagingBytes), "reserved")
	gauge(d.stagingBytes, float64(s.Pool.StagingUsed), "used")
	gauge(d.slots, float64(s.Pool.SlotsTotal), "total")
	gauge(d.slots, float64(s.Pool.SlotsFree), "free")
	gauge(d.ready, float64(s.Pool.BlocksReady), TierCPU)
	gauge(d.leased, float64(s.Pool.BlocksLeased), TierCPU)
	gauge(d.blockBytes, float64(s.Pool.BlockBytes), TierCPU)
	gauge(d.growthTarget, float64(s.Pool.GrowthTargetBytes), TierCPU)
	gauge(d.growthPaused, b(s.Pool.GrowthPaused), TierCPU)
	gauge(d.growthDone, b(s.Pool.FullPool > 0), TierCPU)
	gauge(d.growthError, b(s.Pool.GrowthError != ""), TierCPU)
	gauge(d.regions, float64(s.Pool.Regions), "pinned")
	gauge(d.regions, float64(s.Pool.RegionsTotal), "planned")
	counter(d.trims, s.Pool.Trims, TierCPU)
	counter(d.trimmed, s.Pool.TrimmedBytes, TierCPU)
	if s.Disk.Mode != "" {
		c.collectDisk(ch, s)
	}
	if s.Cluster.Configured {
		c.collectCluster(ch, s)
	}
}

// collectCluster adds the cluster tier's series (tier="cluster"), present
// only when the engine has one. Lookup never asks the cluster; Prefetch
// does: its lookups are the blocks Prefetch asked of it, its hits and
// misses theirs.
func (c *Collector) collectCluster(ch chan<- prometheus.Metric, s offload.Stats) {
	d := &c.d
	metric := func(desc *prometheus.Desc, t prometheus.ValueType, v int64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(desc, t, float64(v), append([]string{TierCluster}, labels...)...)
	}
	counter := prometheus.CounterValue
	metric(d.blockLookups, counter, s.Cluster.Hits+s.Cluster.Misses)
	metric(d.hits, counter, s.Cluster.Hits)
	metric(d.misses, counter, s.Cluster.Misses)
	metric(d.tierReads, counter, s.Cluster.Hits, "hit")
	metric(d.tierReads, counter, s.Cluster.Misses, "miss")
	metric(d.tierFailures, counter, s.Cluster.Timeouts, "timeout")
	metric(d.tierFailures, counter, s.Cluster.Errors, "error")
	metric(d.tierFailures, counter, s.Cluster.Unavailable-s.Cluster.UnavailableWrites, "unavailable")
	metric(d.tierWrites, counter, s.Cluster.Writes, "written")
	metric(d.tierWrites, counter, s.Cluster.WriteErrors, "error")
	metric(d.tierWrites, counter, s.Cluster.Dropped, "dropped")
	metric(d.tierWrites, counter, s.Cluster.UnavailableWrites, "unavailable")
	metric(d.tierCorrupt, counter, s.Cluster.Corrupt)
	metric(d.tierTransferred, counter, s.Cluster.WriteBytes, "written")
	metric(d.tierTransferred, counter, s.Cluster.HitBytes, "read")
	available := int64(0)
	if s.Cluster.Available {
		available = 1
	}
	metric(d.tierAvailable, prometheus.GaugeValue, available)
}

// collectDisk adds the disk tier's series (tier="disk"), present only when
// the engine has one. A key a Lookup did not find in the host pool is
// looked up on disk: the disk's lookups are the host's misses, its hits
// Stats.Disk.LookupHits.
func (c *Collector) collectDisk(ch chan<- prometheus.Metric, s offload.Stats) {
	d := &c.d
	metric := func(desc *prometheus.Desc, t prometheus.ValueType, v int64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(desc, t, float64(v), append([]string{TierDisk}, labels...)...)
	}
	counter, gauge := prometheus.CounterValue, prometheus.GaugeValue
	metric(d.blockLookups, counter, s.Misses)
	metric(d.hits, counter, s.Disk.LookupHits)
	metric(d.misses, counter, s.Misses-s.Disk.LookupHits)
	metric(d.admission, counter, s.Disk.NotAdmitted)
	metric(d.tierReads, counter, s.Disk.Hits, "hit")
	metric(d.tierReads, counter, s.Disk.Misses, "miss")
	metric(d.tierWrites, counter, s.Disk.Writes, "written")
	metric(d.tierWrites, counter, s.Disk.WriteErrors, "error")
	metric(d.tierWrites, counter, s.Disk.Dropped, "dropped")
	metric(d.tierCopies, counter, s.Disk.Copies)
	metric(d.tierCorrupt, counter, s.Disk.Corrupt)
	metric(d.tierDiscarded, counter, s.Disk.TornAtOpen, "torn")
	metric(d.tierDiscarded, counter, s.Disk.StaleAtOpen, "stale")
	metric(d.tierIOErrors, counter, s.Disk.IOErrors-s.Disk.NoSpace, "io")
	metric(d.tierIOErrors, counter, s.Disk.NoSpace, "no_space")
	metric(d.tierEvictions, counter, s.Disk.Evictions)
	metric(d.tierDirs, gauge, int64(s.Disk.Dirs-s.Disk.ReadOnlyDirs), "read_write")
	metric(d.tierDirs, gauge, int64(s.Disk.ReadOnlyDirs), "read_only")
	metric(d.tierDirs, gauge, int64(s.Disk.UnusableDirs), "unusable")
	metric(d.tierRecords, gauge, s.Disk.Records)
	metric(d.tierBytes, gauge, s.Disk.Bytes)
	metric(d.tierCapacity, gauge, s.Disk.Capacity)
	metric(d.tierMode, gauge, 1, s.Disk.Mode)
}

// histogram turns Stats' log2 latency histogram into a Prometheus one:
// bucket i's bound is 2^i µs (see offload.Histogram; the last bucket, which
// has no bound, is +Inf).
func histogram(desc *prometheus.Desc, h offload.Histogram, label string) prometheus.Metric {
	last := len(h.Counts) - 1
	buckets := make(map[float64]uint64, last)
	var cum uint64
	for i := 0; i < last; i++ {
		cum += uint64(h.Counts[i])
		buckets[(time.Duration(1<<uint(i)) * time.Microsecond).Seconds()] = cum
	}
	// The snapshot is not atomic: a bucket read after Count may have moved on.
	return prometheus.MustNewConstHistogram(desc, max(uint64(h.Count), cum+uint64(h.Counts[last])), h.Sum.Seconds(), buckets, label)
}

// Registry returns a registry holding a Collector of src.
func Registry(src Source, constLabels prometheus.Labels) *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(New(src, constLabels))
	return reg
}

// Handler serves src's metrics (the /metrics endpoint).
func Handler(src Source) http.Handler {
	return promhttp.HandlerFor(Registry(src, nil), promhttp.HandlerOpts{Timeout: 10 * time.Second})
}

// WriteText writes src's metrics in the Prometheus text exposition format,
// what /metrics serves to a client that asks for text.
func WriteText(w io.Writer, src Source) error {
	mfs, err := Registry(src, nil).Gather()
	if err != nil {
		return err
	}
	enc := expfmt.NewEncoder(w, expfmt.NewFormat(expfmt.TypeTextPlain))
	for _, mf := range mfs {
		if err := enc.Encode(mf); err != nil {
			return err
		}
	}
	return nil
}
