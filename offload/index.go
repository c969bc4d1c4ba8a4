package offload

import "github.com/kvoffload/kvoffload/kvcache"

// index is the block index and slot pool as the engine's ops use them
// (Engine.cache): *kvcache.Cache in an engine of New (the embedded index,
// whose calls are unchanged), *nodeIndex in an engine of Dial (the node's,
// through a nodepool.Client; index_node.go). Slots are kvcache.Slots in
// both; the pool's own growth, trim and reaping (AddRegion, RemoveRegion,
// TakeReleasable) are the embedded engine's alone and go through
// Engine.kc.
type index interface {
	Lookup(keys []Key) int
	LookupLease(keys []Key, dst []kvcache.Slot) (int, []kvcache.Slot)
	Unlease(slots []kvcache.Slot) error
	BeginStore(req kvcache.StoreRequest, dst []kvcache.StoreResult) ([]kvcache.StoreResult, error)
	CompleteStore(slots []kvcache.Slot, err error) error
	CompleteStoreReady(slots []kvcache.Slot, err error, dst []kvcache.Slot) ([]kvcache.Slot, error)
	ExpirePartials()
	BeginLoad(keys []Key, blockIDs []int, dst []kvcache.LoadResult) ([]kvcache.LoadResult, error)
	EndLoad(slots []kvcache.Slot) error
	Delete(keys []Key) int
	Clear(ns kvcache.Namespace) int
	Stats() kvcache.Stats
}

var _ index = (*kvcache.Cache)(nil)

// storeRefusedBusy is an index's StoreOutcome for a key it cannot reserve
// now and might later (the node unavailable, or the slot's region not yet
// registered here): OutcomeRefusedBusy. kvcache never returns it.
const storeRefusedBusy kvcache.StoreOutcome = 200
