package nodepool

// Stats, the node's state as a client's Stats call returns it, and
// Server.Stats, which takes it.
//
// Locks: Server.Stats takes s.mu for the node's tables, then, once it is
// released, reads the cache's and the disk tier's counters, then takes
// s.accts.mu: none nested.

import (
	"github.com/kvoffload/kvoffload/kvcache"
)

// Stats is a node's state, as a client's Stats call returns it.
type Stats struct {
	PoolBytes       int64  `json:"pool_bytes"`
	Regions         int    `json:"regions"`
	RegionsRetiring int    `json:"regions_retiring"`
	FreedBytes      int64  `json:"freed_bytes"`
	SlotSize        uint64 `json:"slot_size"`
	PageMode        string `json:"page_mode"`
	Clients         int    `json:"clients"`
	// WaitingExit: clients disconnected without goodbye whose processes
	// still run; their reservations and leases are held until they exit.
	WaitingExit    int               `json:"waiting_exit"`
	Namespaces     map[string]uint32 `json:"namespaces"`
	Cache          kvcache.Stats     `json:"cache"`
	Accepted       uint64            `json:"accepted"`
	Refused        uint64            `json:"refused"`
	Malformed      uint64            `json:"malformed"`
	ReleasedOnExit uint64            `json:"released_on_exit"`
	ReleasedOnBye  uint64            `json:"released_on_bye"`
	EventsDropped  uint64            `json:"events_dropped"`
	PeersDropped   uint64            `json:"peers_dropped"`
	// InternalErrors counts states the node never expects (a client
	// holding two generations of one slot); 0 unless there is a bug.
	InternalErrors uint64 `json:"internal_errors"`
	// Connections: connections open now (said Hello or not); ConnsRefused:
	// connections refused past MaxConns or MaxConnsPerClient (also counted
	// in Refused); AcceptErrors: accepts that failed (out of descriptors or
	// memory, a connection aborted) and were retried; HelloTimeouts:
	// connections closed for saying no Hello within HelloTimeout.
	Connections   int    `json:"connections"`
	ConnsRefused  uint64 `json:"conns_refused"`
	AcceptErrors  uint64 `json:"accept_errors"`
	HelloTimeouts uint64 `json:"hello_timeouts"`
	// ShareSlots: the slots one client process may hold at once
	// (ClientShare of the pool; 0 before the first client). OverShare:
	// requests cut short by it (or by a slot's lease or load count).
	// ReservationsExpired: reservations not committed within
	// ReserveTimeout.
	ShareSlots          int64  `json:"share_slots"`
	OverShare           uint64 `json:"over_share"`
	ReservationsExpired uint64 `json:"reservations_expired"`
	// The disk tier (ServerConfig.Disk); all 0 without one.
	DiskLookupHits  int64  `json:"disk_lookup_hits"`  // keys Lookups found on disk after the pool's hits
	DiskHits        int64  `json:"disk_hits"`         // blocks BeginLoad promoted from disk
	DiskMisses      int64  `json:"disk_misses"`       // promotions whose record was missing or failed a check
	DiskWrites      int64  `json:"disk_writes"`       // blocks written to disk: evictions written back, and with WriteThrough blocks written through
	DiskWriteErrors int64  `json:"disk_write_errors"` // writes the store refused or failed
	DiskDropped     int64  `json:"disk_dropped"`      // blocks not written: an admitted eviction past WriteBackBytes waiting, or a ready block finding the write-through queue full
	DiskRecords     int64  `json:"disk_records"`      // records on disk now
	DiskCorrupt     int64  `json:"disk_corrupt"`      // records that failed a check when read
	DiskError       string `json:"disk_error,omitempty"`
	DiskOpen        bool   `json:"disk_open,omitempty"` // the tier is open and serving
	// DiskNotAdmitted: evictions the admission filter kept off disk (key
	// seen fewer than AdmitAfter times).
	DiskNotAdmitted int64 `json:"disk_not_admitted"`
	// DiskCopies: write-backs copied out of their slot first (a store
	// needed the slot at once); the others are written from their demoting
	// slot (Cache.Demotions).
	DiskCopies int64 `json:"disk_copies"`
	// DiskHitsWriting: DiskHits copied from a write-back in flight (the
	// block's slot or copy) rather than read from its record.
	DiskHitsWriting int64 `json:"disk_hits_writing"`
	// DiskWrittenAtClose: the pool's blocks Close wrote to disk
	// (tiered.DiskConfig.WriteBackOnClose); not counted in DiskWrites.
	DiskWrittenAtClose int64 `json:"disk_written_at_close"`
	// DiskLeftAtClose: blocks not on disk that Close did not write
	// because CloseContext's context ended first.
	DiskLeftAtClose int64 `json:"disk_left_at_close"`
}

// Stats returns a snapshot of the node's state.
func (s *Server) Stats() Stats {
	s.mu.Lock()
	st := Stats{PoolBytes: s.cfg.PoolBytes, Regions: len(s.regions), FreedBytes: s.freedBytes, SlotSize: s.slotSize,
		PageMode: s.pageMode, Clients: len(s.peers), Namespaces: map[string]uint32{}}
	for _, rr := range s.regions {
		if rr.state != regionActive {
			st.RegionsRetiring++
		}
	}
	for n, ns := range s.namespaces {
		st.Namespaces[n] = ns.id
	}
	for _, w := range s.waits {
		st.WaitingExit += len(w.peers)
	}
	c := s.cache
	d := s.disk
	st.DiskError = s.diskErr
	s.mu.Unlock()
	if c != nil {
		st.Cache = c.Stats()
	}
	if d != nil {
		st.DiskOpen = true
		ds := d.Store.Stats()
		st.DiskLookupHits, st.DiskHits, st.DiskMisses = d.LookupHits.Load(), d.Hits.Load(), d.Misses.Load()
		st.DiskWrites, st.DiskWriteErrors, st.DiskDropped = d.WB.Writes.Load(), d.WB.WriteErrors.Load(), d.WB.Dropped.Load()
		st.DiskRecords, st.DiskCorrupt = ds.Records, ds.Corrupt
		st.DiskNotAdmitted, st.DiskCopies, st.DiskHitsWriting = d.NotAdmitted.Load(), d.WB.Copies.Load(), d.WB.Served.Load()
		st.DiskWrittenAtClose, st.DiskLeftAtClose = d.AtClose.Load(), d.LeftAtClose.Load()
	}
	st.Accepted = s.counter.accepted.Load()
	st.Refused = s.counter.refused.Load()
	st.Malformed = s.counter.malformed.Load()
	st.ReleasedOnExit = s.counter.releasedOnExit.Load()
	st.ReleasedOnBye = s.counter.releasedOnBye.Load()
	st.EventsDropped = s.counter.eventsDropped.Load()
	st.PeersDropped = s.counter.peersDropped.Load()
	st.InternalErrors = s.counter.internal.Load()
	st.ConnsRefused, st.AcceptErrors = s.counter.refusedCap.Load(), s.counter.acceptErrors.Load()
	st.HelloTimeouts, st.OverShare, st.ReservationsExpired = s.counter.helloTimeouts.Load(), s.counter.overShare.Load(), s.counter.expired.Load()
	s.accts.mu.Lock()
	st.Connections, st.ShareSlots = s.accts.conns, s.accts.share
	s.accts.mu.Unlock()
	return st
}
