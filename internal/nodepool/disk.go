package nodepool

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvoffload/kvoffload/internal/kvseen"
	"github.com/kvoffload/kvoffload/internal/tier/record"
	"github.com/kvoffload/kvoffload/internal/tiered"
	"github.com/kvoffload/kvoffload/kvcache"
)

// The node's disk tier is a tiered.Tier (ServerConfig.Disk, a
// tiered.DiskConfig): the node does the disk I/O, straight between its
// records and the pool's slots; clients only copy between slots and their
// GPU, as without a disk tier. Its admission counts stores and lookups
// through the node in a kvseen.Counter (AdmitAfter at most
// kvseen.Max, 15; a store of head ranges counts once per block,
// the range that starts at head 0), and its write-throughs go from the
// slots (tiered.Config.ThroughFromSlot: `kvoffload serve
// --disk-write-through`). A Lookup reports, after the pool's hits, how
// many following keys the disk holds (LookupTiers); a BeginLoad of such
// keys promotes them first: the node reserves slots for them as a store
// would, reads their records into the slots (tiered.Readers at once),
// makes the good ones ready and hands them out as found. Delete deletes
// the keys' records, also one being written; Clear of any namespace
// empties the tier. WriteBackOnClose has the node's Close write the
// pool's ready blocks not on disk yet once the clients are disconnected
// and the queued writes are written (`kvoffload serve
// --disk-write-back-on-close`): a block already evicted and accepted for
// its write-back but still read by a client when the tier closes is not
// written (it is no longer in the pool's index).

// nodeDiskNamespace is the namespace in the fingerprint of the node's
// records: one node serves one slot layout (its first client's) for every
// namespace, and its keys name their namespace's prefixes themselves.
const nodeDiskNamespace = "kvoffload-node"

// regionBytes is the node's mapping of each region at open (the pool is
// fixed at start), by region id.
type regionBytes struct {
	mem  map[uint32][]byte
	slot uint64
}

// slotBytes returns slot sl's bytes in the node's mapping of its region
// (nil for a region the node never had). The caller holds the slot (a
// lease, a reservation, or a demoting or evicting slot under the cache's
// lock): its region is mapped meanwhile. Never takes a lock.
func (r *regionBytes) slotBytes(sl kvcache.Slot) []byte {
	mem := r.mem[uint32(sl.Region)]
	if sl.Off+r.slot > uint64(len(mem)) {
		return nil
	}
	return mem[sl.Off : sl.Off+r.slot]
}

// openDisk opens the disk tier for layout (newCache, s.mu held, before
// the cache exists: its Demote and OnDemote are the tier's). Start then
// hands it the cache and starts its writers. An error leaves the node
// serving without it (Stats.DiskError).
func (s *Server) openDisk(layout *kvcache.Layout, kind kvcache.LayoutKind) (*tiered.Tier, error) {
	dc := s.cfg.Disk
	g := layout.Geometry()
	fp := record.Fingerprint(record.Geometry{Namespace: []byte(nodeDiskNamespace), KVHeads: g.KVHeads, Layers: g.Layers,
		HeadDim: g.HeadDim, DTypeBytes: g.DTypeBytes, TokensPerBlock: g.TokensPerBlock, LayoutKind: uint8(kind),
		HostFormat: uint8(record.HostDeviceOrder)})
	rb := &regionBytes{mem: map[uint32][]byte{}, slot: layout.SlotSize()}
	for id, rr := range s.regions {
		rb.mem[id] = rr.r.Bytes()
	}
	cfg := tiered.Config{Disk: *dc, SlotBytes: int64(rb.slot), Fingerprint: fp, Bytes: rb.slotBytes,
		Released: func(kvcache.Slot) { s.reap() }, ThroughFromSlot: true,
		BeforePut: s.beforeDiskPut, BeforeGet: s.beforeDiskGet, BeforePutAtClose: s.beforeDiskPut}
	if !dc.AdmitAll && dc.AdmitAfter > 1 {
		cfg.Sketch = kvseen.NewCounter[kvcache.Key]()
	}
	d, err := tiered.Open(cfg)
	if err != nil {
		return nil, fmt.Errorf("nodepool: opening the disk tier (Disk.Dirs %q): %w", dc.Dirs, err)
	}
	return d, nil
}

// checkDisk checks ServerConfig.Disk and fills its defaults on a copy
// (NewServer).
func checkDisk(dc *tiered.DiskConfig) (*tiered.DiskConfig, error) {
	if dc == nil {
		return nil, nil
	}
	d, err := dc.Check(kvseen.Max, nil)
	if err != nil {
		return nil, fmt.Errorf("nodepool: %w", err)
	}
	return &d, nil
}

// promote brings the keys at pos (missing from the pool, held by the disk
// or a write-back in flight) into the pool for a BeginLoad or a Promote:
// slots reserved as a store of namespace ns would (key j's parent
// parent(j): one chain per run of them), records read straight into them
// (tiered.Readers at once), the good ones made ready. It returns nothing:
// the caller's BeginLoad finds what was promoted.
func (s *Server) promote(ns kvcache.Namespace, keys []kvcache.Key, parent func(j int) kvcache.Key, pos []int) {
	d := s.disk
	c := s.cache
	var pkeys []kvcache.Key
	for _, j := range pos {
		pkeys = append(pkeys, keys[j])
	}
	// One BeginStore per run of consecutive positions that chain.
	var slots []kvcache.Slot
	var skeys []kvcache.Key
	for i := 0; i < len(pos); {
		j := i + 1
		for j < len(pos) && pos[j] == pos[j-1]+1 && parent(pos[j]) == keys[pos[j-1]] {
			j++
		}
		res, err := c.BeginStore(kvcache.StoreRequest{Namespace: ns, Parent: parent(pos[i]), Keys: pkeys[i:j], BlockIDs: blockIDs[:j-i]}, nil)
		if err == nil {
			for k, r := range res {
				if r.Outcome == kvcache.StoreWrite {
					slots, skeys = append(slots, r.Slot), append(skeys, pkeys[i+k])
				}
			}
		}
		i = j
	}
	if len(slots) == 0 {
		return
	}
	ok := make([]bool, len(slots))
	mems := make([][]byte, len(slots))
	for i := range slots {
		mems[i] = d.SlotBytes(slots[i])
	}
	d.Read(context.Background(), skeys, mems, func(i int, good bool) { ok[i] = good })
	_, _ = tiered.Settle(c, slots, ok, errDiskMiss, d.Promoted)
	s.reap()
}

var errDiskMiss = errors.New("nodepool: disk record missing or damaged")

// closeDisk closes the disk tier (tiered.Tier.Close: the queued writes
// written, the writers stopped, with WriteBackOnClose the pool's blocks
// written within ctx, the store closed); the node's calls have ended, the
// cache is still open (Close).
func (s *Server) closeDisk(ctx context.Context) {
	if s.disk != nil {
		_ = s.disk.Close(ctx, s.cfg.Disk.WriteBackOnClose)
	}
}

// promoteMissing (BeginLoad or Promote, with a disk tier) promotes the
// keys that the call's BeginLoad did not find in the pool (res) and the
// disk holds (key j's parent parent(j)), then loads them into res: found
// if promoted, missing if their read failed.
func (s *Server) promoteMissing(ns kvcache.Namespace, keys []kvcache.Key, parent func(j int) kvcache.Key, res []kvcache.LoadResult) {
	var pos []int
	for j, r := range res {
		if !r.Found && s.disk.Has(keys[j]) {
			pos = append(pos, j)
		}
	}
	if len(pos) == 0 {
		return
	}
	s.promote(ns, keys, parent, pos)
	pk := make([]kvcache.Key, len(pos))
	for i, j := range pos {
		pk[i] = keys[j]
	}
	got, err := s.cache.BeginLoad(pk, blockIDs[:len(pk)], nil)
	if err != nil {
		return
	}
	for i, j := range pos {
		res[j] = got[i]
	}
}
