package offload

import (
	"errors"
	"fmt"

	"github.com/kvoffload/kvoffload/internal/nodepool"
	"github.com/kvoffload/kvoffload/kvcache"
)

// nodeIndex is the index of an engine of Dial: the node's, one round trip
// per call (nodepool.Pool's mapping from kvcache.Cache calls). Slots are
// kvcache.Slots whose Region is nodeRegion(node region id, connection
// epoch): unique for the client's lifetime, so the engine's in-flight
// counts (hold, gate) and the region hooks tell a region of a node that
// went away from the new node's region of the same id.
//
// ErrUnavailable (the node gone or restarting) never yields a wrong block:
// Lookup reports no hits, BeginStore refuses every key busy, BeginLoad
// fails (offload.ErrUnavailable), Delete and Clear report 0, Stats is
// empty, and a CompleteStore whose commit the node did not take is an
// error (the op reports OutcomeFailed: not stored).
type nodeIndex struct {
	c       *nodepool.Client
	ns      kvcache.Namespace // the engine's id of Config.Namespace, the only one the client stores in
	kvHeads int
}

var _ index = (*nodeIndex)(nil)

// nodeRegion is the engine's kvcache.RegionID of node region id on
// connection epoch.
func nodeRegion(id, epoch uint32) kvcache.RegionID {
	return kvcache.RegionID(uint64(epoch)<<32 | uint64(id))
}

func toKVSlot(s nodepool.Slot) kvcache.Slot {
	return kvcache.Slot{ID: kvcache.SlotID(s.ID), Gen: s.Gen, Region: nodeRegion(s.Region, s.Epoch), Off: s.Off, Addr: s.Addr}
}

func toNodeSlots(slots []kvcache.Slot) []nodepool.Slot {
	out := make([]nodepool.Slot, len(slots))
	for i, s := range slots {
		out[i] = nodepool.Slot{ID: uint32(s.ID), Gen: s.Gen, Region: uint32(s.Region), Epoch: uint32(s.Region >> 32), Off: s.Off, Addr: s.Addr}
	}
	return out
}

// nodeErr maps the client's ErrUnavailable to offload's.
func nodeErr(err error) error {
	if err != nil && errors.Is(err, nodepool.ErrUnavailable) && !errors.Is(err, ErrUnavailable) {
		return fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	return err
}

func (ni *nodeIndex) Lookup(keys []Key) int {
	hits, _, _ := ni.lookupTiers(keys, false, nil)
	return hits
}

func (ni *nodeIndex) LookupLease(keys []Key, dst []kvcache.Slot) (int, []kvcache.Slot) {
	hits, _, dst := ni.lookupTiers(keys, true, dst)
	return hits, dst
}

// lookupTiers is Lookup (lease false) or LookupLease through the node,
// with lower: how many keys after the hits the node's disk tier holds
// (tiered.DiskConfig), which Load has the node promote in chunks
// (beginLoadTiers, promote; Engine.promoteNode).
func (ni *nodeIndex) lookupTiers(keys []Key, lease bool, dst []kvcache.Slot) (hits, lower int, _ []kvcache.Slot) {
	hits, lower, leased, err := ni.c.LookupTiers(keys, lease, nil)
	if err != nil {
		return 0, 0, dst
	}
	if !lease {
		return hits, lower, dst
	}
	if len(leased) > hits {
		_ = ni.c.Unlease(leased[hits:])
		leased = leased[:hits]
	}
	for _, s := range leased {
		dst = append(dst, toKVSlot(s))
	}
	return len(leased), lower, dst
}

func (ni *nodeIndex) Unlease(slots []kvcache.Slot) error {
	if len(slots) == 0 {
		return nil
	}
	return nodeErr(ni.c.Unlease(toNodeSlots(slots)))
}

func (ni *nodeIndex) BeginStore(req kvcache.StoreRequest, dst []kvcache.StoreResult) ([]kvcache.StoreResult, error) {
	if req.Namespace != ni.ns {
		return dst, fmt.Errorf("an engine of Dial stores in its Config.Namespace only (the node keeps one namespace per connection)")
	}
	nreq := nodepool.StoreRequest{Keys: req.Keys, Parent: req.Parent}
	heads := req.Heads
	if heads.Count == 0 || (heads.First == 0 && heads.Count == ni.kvHeads) {
		heads = kvcache.HeadRange{First: 0, Count: ni.kvHeads}
	} else {
		nreq.HeadLo, nreq.HeadHi = heads.First, heads.First+heads.Count
	}
	rs, err := ni.c.BeginStore(nreq, nil)
	if err != nil {
		if !errors.Is(err, nodepool.ErrUnavailable) {
			return dst, err
		}
		for i := range req.Keys {
			dst = append(dst, kvcache.StoreResult{Outcome: storeRefusedBusy, BlockID: req.BlockIDs[i]})
		}
		return dst, nil
	}
	for i, r := range rs {
		out := kvcache.StoreResult{BlockID: req.BlockIDs[i]}
		switch r.Outcome {
		case nodepool.StoreWrite:
			out.Outcome, out.Slot, out.Heads = kvcache.StoreWrite, toKVSlot(r.Slot), heads
			if nreq.HeadHi > 0 {
				out.Slot.Heads = heads
			}
		case nodepool.StorePresent:
			out.Outcome = kvcache.StorePresent
		case nodepool.StoreRefusedFull:
			out.Outcome = kvcache.StoreRefusedFull
		case nodepool.StoreRefusedAdmission:
			out.Outcome = kvcache.StoreRefusedAdmission
		default: // StoreUnusable: the slot's region is not registered here (yet)
			out.Outcome = storeRefusedBusy
		}
		dst = append(dst, out)
	}
	return dst, nil
}

// CompleteStore commits the slots (their copies retired) or, with err,
// aborts them. A commit the node did not take (it went away since
// BeginStore) is an error: those blocks are not stored.
func (ni *nodeIndex) CompleteStore(slots []kvcache.Slot, err error) error {
	if len(slots) == 0 {
		return nil
	}
	if err != nil {
		return nodeErr(ni.c.AbortStore(toNodeSlots(slots)))
	}
	return nodeErr(ni.c.CommitStore(toNodeSlots(slots)))
}

// CompleteStoreReady is CompleteStore. The node makes a block ready when
// its last head range is committed, which this client does not learn: a
// dialled engine reports every committed slot as ready (for the cluster
// write-through, which a dialled engine does not have).
func (ni *nodeIndex) CompleteStoreReady(slots []kvcache.Slot, err error, dst []kvcache.Slot) ([]kvcache.Slot, error) {
	if cerr := ni.CompleteStore(slots, err); cerr != nil || err != nil {
		return dst, cerr
	}
	return append(dst, slots...), nil
}

// ExpirePartials does nothing here: the node expires its partial blocks
// (kvcache's PartialTimeout, at its next store).
func (ni *nodeIndex) ExpirePartials() {}

// BeginLoad is the node's BeginLoad, which promotes the keys its disk
// tier holds before it answers. Load goes through beginLoadTiers and
// promote instead.
func (ni *nodeIndex) BeginLoad(keys []Key, blockIDs []int, dst []kvcache.LoadResult) ([]kvcache.LoadResult, error) {
	if len(keys) == 0 {
		return dst, nil
	}
	rs, err := ni.c.BeginLoad(keys, nil)
	if err != nil {
		return dst, nodeErr(err)
	}
	return appendLoaded(dst, rs, blockIDs), nil
}

// beginLoadTiers is BeginLoad without the node's promotion
// (Client.BeginLoadTiers, the same round trip): the keys the pool lacks
// and the node's disk holds are not found, and their indices in keys are
// appended to lower.
func (ni *nodeIndex) beginLoadTiers(keys []Key, blockIDs []int, dst []kvcache.LoadResult, lower []int) ([]kvcache.LoadResult, []int, error) {
	if len(keys) == 0 {
		return dst, lower, nil
	}
	rs, err := ni.c.BeginLoadTiers(keys, nil)
	if err != nil {
		return dst, lower, nodeErr(err)
	}
	dst = appendLoaded(dst, rs, blockIDs)
	for i, r := range rs {
		if r.OnDisk {
			lower = append(lower, i)
		}
	}
	return dst, lower, nil
}

// promote has the node promote keys from its disk tier (key i's parent
// parents[i]) and begin their load into blockIDs (Client.Promote): one
// result per key, found or not (its record missing or damaged).
func (ni *nodeIndex) promote(keys, parents []Key, blockIDs []int) ([]kvcache.LoadResult, error) {
	rs, err := ni.c.Promote(keys, parents, nil)
	if err != nil {
		return nil, nodeErr(err)
	}
	return appendLoaded(make([]kvcache.LoadResult, 0, len(rs)), rs, blockIDs), nil
}

// appendLoaded appends the node's load results rs, into blockIDs, to dst.
func appendLoaded(dst []kvcache.LoadResult, rs []nodepool.LoadResult, blockIDs []int) []kvcache.LoadResult {
	for i, r := range rs {
		out := kvcache.LoadResult{Found: r.Found, BlockID: blockIDs[i]}
		if r.Found {
			out.Slot = toKVSlot(r.Slot)
		}
		dst = append(dst, out)
	}
	return dst
}

func (ni *nodeIndex) EndLoad(slots []kvcache.Slot) error {
	if len(slots) == 0 {
		return nil
	}
	return nodeErr(ni.c.EndLoad(toNodeSlots(slots)))
}

func (ni *nodeIndex) Delete(keys []Key) int {
	n, _ := ni.c.Delete(keys)
	return n
}

func (ni *nodeIndex) Clear(ns kvcache.Namespace) int {
	if ns != ni.ns {
		return 0
	}
	n, _ := ni.c.Clear()
	return n
}

func (ni *nodeIndex) Stats() kvcache.Stats {
	st, err := ni.c.Stats()
	if err != nil {
		return kvcache.Stats{}
	}
	return st.Cache
}
