package nodepool

// Pool is the block index and slot pool as an engine (package offload)
// uses them, whether embedded or shared through a node; *Client
// implements it. Slots are host addresses in this process (Slot.Addr),
// valid while the slot is reserved, leased or loaded by the caller.
//
// How offload becomes offload.Dial(socket, cfg): it builds the Engine as
// New does (backend, transfer context, copier, staging buffers, op
// machinery) but maps and pins no pool of its own and runs no growth
// stages; it Dials with ClientConfig{Namespace: cfg.Namespace, Layout:
// LayoutOf(kind, geometry of cfg.Layout)} and these hooks:
//
//   - Hooks.RegionAdded(r): register r (register.NewCUDA on the CUDA
//     backend, in ≤ 64 GiB ranges; mlock or nothing on the host backend)
//     and hand its ranges to the copier, as the growth thread does for a
//     region of its own. The first region is added inside Dial, the rest
//     in the background, in order.
//   - Hooks.RegionRetiring(r): wait until no op of the engine has a copy
//     on r in flight (count in-flight copies per region id; after a Trim
//     there are none, after the node was lost there may be), then
//     unregister r. The client unmaps it after the hook returns.
//
// Then each index call of the engine on its kvcache.Cache maps to one
// call here (one round trip per op, not per block):
//
//	kvcache.Cache (embedded)                Pool (node)
//	Lookup(keys)                            Lookup(keys, false, nil)
//	LookupLease(keys, dst)                  Lookup(keys, true, dst)
//	Unlease(slots)                          Unlease(slots)
//	BeginStore(StoreRequest{Parent, Keys})  BeginStore(StoreRequest{Parent | Parents, Keys, HeadLo, HeadHi})
//	CompleteStore(slots, nil)               CommitStore(slots)
//	CompleteStore(slots, err)               AbortStore(slots)
//	BeginLoad(keys, blockIDs)               BeginLoad(keys)  (results in key order; pair them with the block ids)
//	EndLoad(slots)                          EndLoad(slots)
//	Delete(keys)                            Delete(keys)
//	Clear(ns)                               Clear()  (the client's namespace)
//	Stats()                                 Stats()  (Stats.Cache is the node's kvcache.Stats)
//	RemoveRegion + TakeReleasable (Trim)    Trim(bytes) (node-wide: every client's mapping of the region retires)
//	AddRegion (growth)                      Hooks.RegionAdded
//	Config.OnIndex (Engine.Events)          ClientConfig.OnEvents (no parents or tokens: the node knows keys only)
//
// Outcomes: StoreWrite → copy D2H to Slot.Addr, then CommitStore once its
// events retired (AbortStore if the copy failed); StorePresent →
// OutcomeAlreadyPresent; StoreRefusedFull → OutcomeRefusedFull;
// StoreRefusedAdmission → OutcomeRefusedAdmission; StoreUnusable (the
// slot's region is not registered in this process yet; the client already
// gave it back) → OutcomeRefusedBusy. A Load with a Lease copies from the
// leased slots and Unleases them when its copies retired; without one it
// takes BeginLoad's slots and EndLoads them. ErrUnavailable from any call:
// Lookup reports no hits, Store refuses its blocks as busy, Load fails
// with a wrapped ErrUnavailable (offload.ErrUnavailable), Delete and
// Clear report 0; a CommitStore that fails with ErrUnavailable means the
// blocks were not stored (OutcomeFailed). Close: end every op (wait for
// copies), then Client.Close (goodbye), then release the transfer context.
// Not through the node in this round: the engine's own disk and cluster
// tiers (Config.Disk, Config.Cluster: they hang on the embedded cache; the
// node has a disk tier of its own, ServerConfig.Disk), ZeroOnRelease (a
// node-side option to add), GrowTo and PauseGrowth (the node maps its pool
// at start).
// The C ABI and Python get kvo_engine_connect(socket, config JSON), returning
// the same engine handle as kvo_engine_create, and Engine.connect. (offload
// keeps slots as kvcache.Slots: Region = Slot.Epoch<<32 | Slot.Region, which
// names a region for the client's lifetime.)
type Pool interface {
	Lookup(keys []Key, lease bool, dst []Slot) (hits int, leased []Slot, err error)
	Unlease(slots []Slot) error
	BeginStore(req StoreRequest, dst []StoreResult) ([]StoreResult, error)
	CommitStore(slots []Slot) error
	AbortStore(slots []Slot) error
	BeginLoad(keys []Key, dst []LoadResult) ([]LoadResult, error)
	EndLoad(slots []Slot) error
	Delete(keys []Key) (int, error)
	Clear() (int, error)
	Stats() (Stats, error)
	Trim(bytes int64) (TrimResult, error)
	Close() error
}

var _ Pool = (*Client)(nil)
