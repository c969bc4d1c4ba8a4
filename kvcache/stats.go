package kvcache

// Stats is a snapshot of the cache's gauges and counters. Counters are
// cumulative since New and add up:
//
//	StoreKeys      = StoreAllocated + StorePresent + StoreRefusedFull + StoreRefusedAdmission
//	StoreAllocated = Stored + StoreFailed + StoresInFlight
//	LookupKeys     = LookupHits + LookupMisses
//	LoadKeys       = Loaded + LoadMissing
type Stats struct {
	// Gauges.
	Regions        int // regions in the pool, draining ones included
	Slots          int // slots of regions that are not draining
	Free           int // on the free list
	Writing        int // D2H in progress
	Ready          int // indexed, no reader
	Leased         int // indexed, readers > 0
	Releasing      int // removed from the index, waiting for readers or transfers
	Zeroing        int // released, being zeroed by Config.OnFree (neither free nor readable)
	Demoting       int // evicted and released, handed to Config.OnDemote, until Demoted (readable, not reusable)
	StoresInFlight int // store writes not yet completed (writing, or releasing while writing; one per head-range write)
	// Partial: blocks stored by head ranges that still miss heads (never
	// visible), releasing ones with copies in flight included.
	Partial int

	// Store outcomes, per key.
	StoreKeys             uint64
	StoreAllocated        uint64 // a write was granted (outcome StoreWrite): a slot allocated, or a head range of a partial block
	StoreJoined           uint64 // of StoreAllocated: head ranges granted in a block another range had allocated
	StorePresent          uint64
	StoreRefusedFull      uint64
	StoreRefusedAdmission uint64 // refused before the copy (StoreThreshold)
	Stored                uint64 // CompleteStore without error
	StoreFailed           uint64 // CompleteStore with an error

	// Lookups (per key: hits are the ready prefix, misses the rest) and loads.
	LookupKeys, LookupHits, LookupMisses uint64
	LoadKeys, Loaded, LoadMissing        uint64

	// Removals from the index, per block.
	Evicted  uint64 // by the policy (eviction or low-watermark)
	Rejected uint64 // by the policy's after-the-fact admission (TinyLFU)
	Deleted  uint64 // by Delete or Clear
	Trimmed  uint64 // by RemoveRegion
	// PartialExpired: blocks stored by head ranges reclaimed because heads
	// were still missing after Config.PartialTimeout.
	PartialExpired uint64
	// Orphaned counts blocks whose parent left the index while they were
	// ready: no longest-prefix lookup reaches them any more.
	Orphaned uint64
	// ZeroedUnderLock counts slots Config.OnFree zeroed with the cache's
	// lock held: a store that found no free slot zeroing the slots it had
	// just evicted (every other release zeroes outside the lock).
	ZeroedUnderLock uint64
	// Demotions counts slots handed to Config.OnDemote (demoting).
	Demotions uint64
	// WastedD2HBytes: bytes copied to the host for blocks the policy then
	// rejected (Rejected × slot size).
	WastedD2HBytes uint64
}

// Stats returns a snapshot of the cache's statistics.
func (c *Cache) Stats() Stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := c.st
	st.Regions = len(c.regions)
	st.Slots = c.usable
	st.Free = c.nFree
	st.Writing = c.counts[stateWriting]
	st.Ready = c.counts[stateReady]
	st.Leased = c.counts[stateLeased]
	st.Releasing = c.counts[stateReleasing]
	st.Zeroing = c.counts[stateZeroing]
	st.Demoting = c.counts[stateDemoting]
	st.Partial = c.nPartial
	st.StoresInFlight = int(st.StoreAllocated - st.Stored - st.StoreFailed)
	return st
}

func (c *Cache) setState(s *slotRec, to slotState) {
	if s.state != stateRetired {
		c.counts[s.state]--
	}
	if to != stateRetired {
		c.counts[to]++
	}
	s.state = to
}
