package cluster

// Stats is a snapshot of a store's counters. Counts are since Open.
type Stats struct {
	Puts               int64  // records the cluster stored
	PutErrors          int64  // accepted puts that failed (a node down, a timeout, OOM...)
	PutOOM             int64  // the PutErrors that were a node's OOM refusal (maxmemory with noeviction)
	Dropped            int64  // puts PutAsync refused: over MaxInFlightBytes, the store closed or not Available
	DroppedUnavailable int64  // the Dropped puts refused because the store was not Available
	InFlightBytes      int64  // record bytes accepted and not yet answered
	InFlightPuts       int64  // puts accepted and not yet answered
	PutBytes           int64  // payload bytes of the records the cluster stored
	Hits               int64  // keys Get filled with a verified record
	HitBytes           int64  // payload bytes Get filled
	Misses             int64  // keys Get returned false for; the next six split them
	NotFound           int64  // absent (never written, expired, evicted, cleared)
	Corrupt            int64  // a record failing a checksum, the format version or the length
	Stale              int64  // a record of another fingerprint, host-layout version or key
	Timeouts           int64  // no answer before the deadline
	Errors             int64  // any other failure (a node down, a refused connection, a closed store)
	Unavailable        int64  // asked of a store not Available (not connected yet)
	Available          bool   // connected (see Store.Available)
	ConnectAttempts    int64  // attempts to connect, the one in Open included
	ConnectError       string // why the last attempt failed, while not Available
	Generation         uint64 // the namespace's generation this store reads and writes
	Clears             int64  // Clear calls that bumped the generation
}

// Stats returns the store's counters.
func (s *Store) Stats() Stats {
	s.mu.Lock()
	st := Stats{InFlightBytes: s.inflightBytes, InFlightPuts: s.inflightPuts}
	s.mu.Unlock()
	st.Puts, st.PutErrors, st.PutOOM, st.Dropped = s.puts.Load(), s.putErrors.Load(), s.putOOM.Load(), s.dropped.Load()
	st.Hits, st.NotFound, st.Corrupt, st.Stale = s.hits.Load(), s.notFound.Load(), s.corrupt.Load(), s.stale.Load()
	st.Timeouts, st.Errors, st.Unavailable = s.timeouts.Load(), s.errors.Load(), s.unavailGets.Load()
	st.DroppedUnavailable = s.unavailPuts.Load()
	st.PutBytes, st.HitBytes = s.putBytes.Load(), s.hitBytes.Load()
	st.Misses = st.NotFound + st.Corrupt + st.Stale + st.Timeouts + st.Errors + st.Unavailable
	st.Available, st.ConnectAttempts = s.Available(), s.attempts.Load()
	if m := s.connErr.Load(); m != nil && !st.Available {
		st.ConnectError = *m
	}
	st.Generation, st.Clears = s.gen.Load(), s.clears.Load()
	return st
}
