// Package kvcache is the control plane of the host KV-block cache: layouts
// (block id → device segments), slots carved from host regions handed in by
// the caller, 128-bit chained block keys, the block index with its state
// machine, and the admission/eviction policy. It is pure Go, touches no
// memory and no GPU: it hands out addresses and records what transfers
// report. The engine (package offload) composes it with mmapmem regions,
// register and the transfer scheduler.
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
//
// Only ready and leased blocks are visible to Lookup and BeginLoad. A block
// leaves the index as soon as it is evicted; its slot is reused only after
// every lease is given back and every transfer on it (the store's D2H, each
// load's H2D) is reported done. Transfers report completions: the cache never
// assumes a copy finished. Verify checks all this; the kvoinvariants build tag
// runs it after every call.
//
// # Slots
//
// A region is carved into slots of Layout.SlotSize bytes at addresses aligned
// to Config.SlotAlign (default 4 KiB, see DefaultSlotAlign), none straddling
// a registration range boundary. Free slots form a doubly linked list
// (O(1) allocate, free, and removal of a draining region's slots). Regions
// can be added while serving; RemoveRegion drains one and TakeReleasable
// reports it once every slot is free.
//
// # Policy
//
// The slot pool is the authority; the Policy only advises. LRU (exact,
// deterministic) and TinyLFU (ristretto v2: TinyLFU admission, sampled LFU
// eviction, cost one slot) implement it; Random (seeded) exists for tests.
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
