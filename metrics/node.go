package metrics

import (
	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/prometheus/client_golang/prometheus"
)

// NodeStats is what a node (`kvoffload serve`) exports: the values of its
// Stats that NodeRegistry's series read, as plain numbers (its caller
// converts the node's own Stats).
type NodeStats struct {
	// PoolBytes and FreedBytes: the pool's regions' bytes, and those given
	// back by trims; Regions: the regions mapped (retiring ones included).
	PoolBytes, FreedBytes int64
	Regions               int
	// Clients connected; WaitingExit: clients disconnected without
	// goodbye whose process still runs; Connections open (said Hello or
	// not).
	Clients, WaitingExit, Connections int
	// Cache is the node's block index's (slots, blocks, lookups, stores).
	Cache kvcache.Stats
	// The node's counters.
	Malformed, ReleasedOnExit, EventsDropped, ConnsRefused, AcceptErrors uint64
	HelloTimeouts, OverShare, ReservationsExpired                        uint64
	// The disk tier's: DiskOpen when it is open and serving.
	DiskOpen                                                      bool
	DiskRecords, DiskLookupHits, DiskHits, DiskMisses, DiskWrites int64
	DiskWriteErrors, DiskDropped, DiskNotAdmitted, DiskCorrupt    int64
	DiskWrittenAtClose, DiskLeftAtClose                           int64
}

// NodeRegistry returns a registry of a node's series (kvoffload_node_*),
// each reading stats() when scraped; disk adds the disk tier's
// (kvoffload_node_disk_*).
func NodeRegistry(stats func() NodeStats, disk bool) *prometheus.Registry {
	reg := prometheus.NewRegistry()
	g := func(name, help string, f func(NodeStats) float64) {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: "kvoffload_node", Name: name, Help: help},
			func() float64 { return f(stats()) }))
	}
	c := func(name, help string, f func(NodeStats) float64) {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "kvoffload_node", Name: name, Help: help},
			func() float64 { return f(stats()) }))
	}
	g("pool_bytes", "Bytes of the pool's regions not given back.", func(st NodeStats) float64 { return float64(st.PoolBytes - st.FreedBytes) })
	g("regions", "Regions mapped by the node (retiring ones included).", func(st NodeStats) float64 { return float64(st.Regions) })
	g("clients", "Connected clients.", func(st NodeStats) float64 { return float64(st.Clients) })
	g("clients_waiting_exit", "Clients disconnected without goodbye whose process still runs.", func(st NodeStats) float64 { return float64(st.WaitingExit) })
	g("slots_free", "Free slots.", func(st NodeStats) float64 { return float64(st.Cache.Free) })
	g("slots_writing", "Slots reserved for stores.", func(st NodeStats) float64 { return float64(st.Cache.Writing) })
	g("blocks_ready", "Ready blocks without readers.", func(st NodeStats) float64 { return float64(st.Cache.Ready) })
	g("blocks_leased", "Ready blocks with readers.", func(st NodeStats) float64 { return float64(st.Cache.Leased) })
	c("lookup_hits_total", "Keys found by lookups.", func(st NodeStats) float64 { return float64(st.Cache.LookupHits) })
	c("lookup_misses_total", "Keys missed by lookups.", func(st NodeStats) float64 { return float64(st.Cache.LookupMisses) })
	c("stored_total", "Blocks committed.", func(st NodeStats) float64 { return float64(st.Cache.Stored) })
	c("store_failed_total", "Reservations aborted (or of clients that exited).", func(st NodeStats) float64 { return float64(st.Cache.StoreFailed) })
	c("evicted_total", "Blocks evicted by the policy.", func(st NodeStats) float64 { return float64(st.Cache.Evicted) })
	c("malformed_total", "Messages that did not decode.", func(st NodeStats) float64 { return float64(st.Malformed) })
	c("released_on_exit_total", "Clients whose holdings were released when their process exited.", func(st NodeStats) float64 { return float64(st.ReleasedOnExit) })
	c("events_dropped_total", "KV events dropped by a full queue.", func(st NodeStats) float64 { return float64(st.EventsDropped) })
	g("connections", "Connections open (said Hello or not).", func(st NodeStats) float64 { return float64(st.Connections) })
	c("conns_refused_total", "Connections refused past --max-conns or --max-conns-per-client.", func(st NodeStats) float64 { return float64(st.ConnsRefused) })
	c("accept_errors_total", "Accepts that failed (out of descriptors or memory, a connection aborted) and were retried.", func(st NodeStats) float64 { return float64(st.AcceptErrors) })
	c("hello_timeouts_total", "Connections closed for saying no Hello within --hello-timeout.", func(st NodeStats) float64 { return float64(st.HelloTimeouts) })
	c("over_share_total", "Requests cut short by a client's share of the pool (--client-share) or a slot's lease count.", func(st NodeStats) float64 { return float64(st.OverShare) })
	c("reservations_expired_total", "Reservations not committed within --reserve-timeout.", func(st NodeStats) float64 { return float64(st.ReservationsExpired) })
	if disk {
		// The disk tier's series (--disk); disk_up is 0 while the tier is
		// not open (before the first client's layout) or failed to open.
		g("disk_up", "1 when the disk tier is open and serving, else 0.", func(st NodeStats) float64 {
			if st.DiskOpen {
				return 1
			}
			return 0
		})
		g("disk_records", "Records on disk now.", func(st NodeStats) float64 { return float64(st.DiskRecords) })
		c("disk_lookup_hits_total", "Keys lookups found on disk after the pool's hits.", func(st NodeStats) float64 { return float64(st.DiskLookupHits) })
		c("disk_promoted_total", "Blocks loads promoted from disk into the pool.", func(st NodeStats) float64 { return float64(st.DiskHits) })
		c("disk_misses_total", "Promotions whose record was missing or failed a check.", func(st NodeStats) float64 { return float64(st.DiskMisses) })
		c("disk_writes_total", "Blocks written to disk: evictions written back, and with --disk-write-through blocks written through.", func(st NodeStats) float64 { return float64(st.DiskWrites) })
		c("disk_write_errors_total", "Writes the disk store refused or failed.", func(st NodeStats) float64 { return float64(st.DiskWriteErrors) })
		c("disk_dropped_total", "Blocks not written: admitted evictions past the write-back bound, or ready blocks finding the write-through queue full.", func(st NodeStats) float64 { return float64(st.DiskDropped) })
		c("disk_not_admitted_total", "Evictions the admission filter kept off disk (key seen fewer than --disk-admit-after times).", func(st NodeStats) float64 { return float64(st.DiskNotAdmitted) })
		c("disk_corrupt_total", "Records that failed a check when read.", func(st NodeStats) float64 { return float64(st.DiskCorrupt) })
		c("disk_written_at_close_total", "Blocks of the pool written to disk at shutdown (--disk-write-back-on-close); not in disk_writes_total.", func(st NodeStats) float64 { return float64(st.DiskWrittenAtClose) })
		c("disk_left_at_close_total", "Blocks not on disk that shutdown did not write: --disk-close-timeout passed first.", func(st NodeStats) float64 { return float64(st.DiskLeftAtClose) })
	}
	return reg
}
