// Package kvcache is the control plane of the host KV-block cache: layouts
// (block id → device segments), slots carved from host regions handed in by
// the caller, 128-bit chained block keys, the block index with its state
// machine, and the admission/eviction policy. It is pure Go, touches no
// memory and no GPU: it hands out addresses and records what transfers
// report. The engine (package offload) composes it with mmapmem regions,
// register and the transfer scheduler.
//
// It owns the index and the pool; the caller owns the memory, the copies
// and the keys' meaning. What it promises, whatever the order of calls:
//
//   - Only ready and leased blocks are visible (Lookup, BeginLoad); a slot
//     is reused only after every lease, load and store on it has been given
//     back (see "The life of a block").
//   - A call that fails changes nothing, unless its doc says otherwise.
//     Errors name the bad value; the package exports no sentinel errors.
//   - Every method of Cache is safe for concurrent use; Layout is immutable.
//   - Verify checks these invariants (the kvoinvariants build tag runs it
//     after every call).
//
// Besides the store/lookup/load cycle below, an owner that holds slots on
// behalf of others (a node pool serving several engines, a lower tier
// written from the slots) uses LeaseHandles, LeaseAll, LookupLeaseDeferred
// with Accessed, EndReads and Demoted.
//
// # How the engine uses it
//
//	layout, _ := kvcache.NewLayout(spec)           // from the serving stack's tensors
//	c, _ := kvcache.New(kvcache.Config{Layout: layout, Policy: p, LowWatermark: w})
//	c.AddRegion(kvcache.Region{ID: 1, Base: base, Size: size, RangeStarts: rangeStarts})
//
//	// Store: after prefill, for a request's chain of full blocks.
//	keys, _ := kvcache.ChainKeys(ns, kvcache.Key{}, tokens, layout.Geometry().TokensPerBlock)
//	res, _ := c.BeginStore(kvcache.StoreRequest{Keys: keys, BlockIDs: ids}, nil)
//	// for each res[i].Outcome == StoreWrite: copy layout.Segments(res[i].BlockID)
//	// to res[i].Slot.Addr + seg.Off (D2H); when the copy's events have retired:
//	c.CompleteStore(slots, copyErr)
//
//	// Load: before prefill.
//	n := c.Lookup(keys)                              // or LookupLease to pin them
//	lr, _ := c.BeginLoad(keys[:n], gpuIDs, nil)      // leases + one transfer each
//	// copy each found slot to its GPU block (H2D); when the events retired:
//	c.EndLoad(foundSlots)
//
//	// Trim: c.RemoveRegion(id); later c.TakeReleasable(nil) → unregister, unmap.
//
// # The life of a block
//
//	free ─BeginStore→ writing ─CompleteStore(nil)→ ready ⇄ leased (readers > 0)
//	writing ─CompleteStore(err)→ releasing → free
//	ready/leased/writing ─evict, Delete, Clear, RemoveRegion→ releasing
//	releasing → free once it has no reader and no outstanding transfer
//	releasing → zeroing → free, instead, with Config.OnFree
//	releasing → demoting ─Demoted→ (zeroing →) free, a policy eviction Config.Demote accepted
//	free ─BeginStore(heads)→ writing, partial ─CompleteStore of the last heads→ ready
//	writing, partial ─PartialTimeout, evict, Delete, Clear, RemoveRegion→ releasing
//
// Only ready and leased blocks are visible to Lookup and BeginLoad. A block
// leaves the index as soon as it is evicted; its slot is reused only after
// every lease is given back and every transfer on it (the store's D2H, each
// load's H2D) is reported done. Transfers report completions: the cache never
// assumes a copy finished. Verify checks all this; the kvoinvariants build tag
// runs it after every call.
//
// # Demotion (a lower tier written from the slot)
//
// With Config.Demote and Config.OnDemote, a block the policy evicts may be
// written to a lower tier straight from its slot, with no copy: Demote,
// asked under the lock, accepts it; the block leaves the index at once (a
// lookup misses it from then on, as for any eviction, until the owner's
// tier has it); once its last reader and transfer end, the slot is
// "demoting": its bytes intact, readable by the owner, never handed to a
// store, its region not releasable. OnDemote gets it outside the lock; the
// owner writes it and calls Demoted, which sends it through zeroing (with
// OnFree) to the free list. Demoting slots count towards the low-watermark
// but a store never takes one: when a store needs slots and none is free,
// the victims it evicts for itself are freed at once (Demote is told so),
// and a store is refused as pool full, as before, only when no block may
// be evicted. The owner bounds how many slots it accepts (the cache does
// not): demoting slots are out of the pool until Demoted.
//
// # Tensor-parallel sharing
//
// A block's key and its host bytes do not depend on the tensor-parallel
// (TP) size, so that engines of any TP size share blocks:
//
//   - Keys: the namespace names the model, dtype, tokens per block and
//     layout kind, never the TP rank or size (ChainKeys).
//   - Geometry: KVHeads is the model's, all ranks together; a layout's
//     LayoutSpec.Heads is the rank's range [First, First+Count) of them
//     (zero: all). A record fingerprint carries the model's geometry and
//     the layout's host format (head-major or device order, below).
//   - Host layout: a layout that declares its device order
//     (LayoutSpec.Order: TokenMajor, [blocks, tokens, heads, head_dim] per
//     layer, or HeadMajor, [blocks, heads, tokens, head_dim]) keeps slots
//     head-major: per layer K then V, each holding every
//     head of the model, head by head, each head's tokens × head_dim
//     contiguous. A range of heads is then one contiguous host run per
//     layer and K/V. A layout of undeclared order keeps the
//     slot a byte copy of the device segments (device order), as before
//     head ranges existed: the same segments, the same bytes, whole blocks
//     only.
//   - Segments: Layout.Segments gives, per layer and K/V, the device side
//     of the rank's heads (LayoutSpec.Heads) and their place in the slot. For TokenMajor a head is one 2-D segment
//     (Rows = tokens rows of RowLen = head_dim × dtype bytes, DevPitch =
//     the rank's heads × RowLen on the device, HostPitch = RowLen in the
//     slot); where those rows are contiguous (one head held, one token per
//     block) and always for HeadMajor, one contiguous segment (Rows = 0).
//     A 1-D user reads Rows ≤ 1 as contiguous, as before.
//   - Several writers per block: a store with StoreRequest.Heads writes
//     that range. The first range of an absent key allocates the slot; the
//     block is "partial": indexed, never visible to Lookup or BeginLoad.
//     The other ranks' ranges (sharing no head with the ranges committed
//     or in flight) are writes into the same slot (StoreWrite, with
//     Slot.Heads naming the range), not StorePresent; a range that shares
//     a head is StorePresent, so replicated heads (TP above the KV heads,
//     MLA's latent) are stored once. The block becomes ready when
//     CompleteStore has committed every head; CompleteStoreReady says
//     which completions did that. A failed range write leaves the range
//     open for a retry (the block is dropped if nothing else is committed
//     or in flight). A block still missing heads Config.PartialTimeout
//     after its first range was granted (a rank died) is reclaimed at the
//     next BeginStore or ExpirePartials, and never loaded.
//   - A load by a rank of any TP size takes the ready block (BeginLoad, as
//     before) and copies only its heads: Segments of its own layout.
//   - Pipeline-parallel stages are not supported as layer ranges: a
//     LayoutSpec.Stage other than every layer is refused (see LayerRange).
//
// Every whole-block call (StoreRequest.Heads zero) behaves as before; a
// whole-block store of a partial block's key is StorePresent.
//
// # Slots
//
// A region is carved into slots of Layout.SlotSize bytes at addresses aligned
// to Config.SlotAlign (default 4 KiB, a page), none straddling
// a registration range boundary. Free slots form a doubly linked list
// (O(1) allocate, free, and removal of a draining region's slots). Regions
// can be added while serving; RemoveRegion drains one and TakeReleasable
// reports it once every slot is free.
//
// # Policy
//
// The slot pool is the authority; the Policy only advises. There are two,
// both the package's own: exact LRU (deterministic; Config.Policy nil) and
// TinyLFU (NewTinyLFU: ristretto v2, TinyLFU admission, sampled LFU
// eviction, cost one slot); the tests add a seeded random one.
// Eviction runs inline: every mutating call applies the policy's queued
// advice and evicts until LowWatermark slots are free, so a store normally
// finds a slot at once; there is no background goroutine of the cache's own
// (TinyLFU's goroutines stop in Close). When a burst outruns the watermark
// (or ristretto's asynchronous evictions lag), BeginStore asks the policy
// for as many victims as it lacks slots and evicts those ready blocks
// inline, so a store is refused ("pool full") only when no block may be
// evicted: every one is leased, being written, releasing, or part of the
// chain being stored (its present keys, its parent and the parent's
// ancestors, whose eviction would orphan what the store adds). A store
// never waits and never evicts a leased block. The work is bounded: each
// victim leaves the policy's tracking, and LRU steps over leased blocks
// once per call. Victims are chosen among chain tails first (a block with
// an indexed child goes after the child; LRU touches a hit prefix from its
// tail, so parents stay more recent); Stats.Orphaned counts blocks whose
// parent left the index.
//
// # Concurrency
//
// One mutex guards the cache; each call handles a whole list of blocks
// under one acquisition, so the per-block cost stays low under contention
// (see BenchmarkControlPlane). The policy is called with the lock held;
// ristretto's callbacks never take it. Config.OnFree (zeroing a released
// slot, a memset of the whole slot) runs without it: the call that released
// the slot leaves it "zeroing" (neither free nor readable, its region not
// releasable), calls OnFree after its critical section, then re-takes the
// lock briefly to free it; Close waits for zeroing in progress.
//
// # Admission: store everything, or only what was seen twice?
//
// BenchmarkHitRatio replays trace.Default (multi-turn conversations) with
// both policies, storing every block or only keys seen twice. On it,
// TinyLFU's after-the-fact admission wastes a large share of its D2H bytes
// on blocks it then rejects, and it does not beat LRU: it rejects the fresh
// blocks of a conversation, which its next turn needs. Storing only keys
// looked up twice removes most of that waste, and for pools smaller than
// the working set it raises the hit ratio of both policies while cutting
// D2H traffic several times; when the pool holds the working set it costs
// LRU some hit ratio. The decision: LRU is the default policy;
// StoreThreshold defaults to 1 (store everything) and the engine should
// set it to 2 when its pool is smaller than its working set or link time
// for stores is scarce, and always with TinyLFU.
package kvcache
