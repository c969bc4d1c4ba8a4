// Package offload is the engine a serving stack embeds to move KV-cache
// blocks between its GPU KV cache and a pool of pinned host memory, so that
// prefixes evicted from the GPU come back at PCIe speed instead of being
// recomputed. It is the only package of kvoffload a Go user imports.
//
// # Setting up
//
// New takes a Config: the pool size in bytes (exact, never rounded to a
// power of two), the Layout of the stack's GPU KV cache (its geometry and
// the device addresses of its tensors), and optional tuning whose defaults
// suit a GPU serving machine. Backend "auto" (the default) picks CUDA when
// libcuda.so.1 loads, the device exists and the layout gives device
// addresses; otherwise the host backend, which simulates the GPU in host
// memory so the same engine runs in CI and on laptops. Engine.Backend says
// which was picked and why. The Config enums (Backend, HostPinning,
// HugePages, Policy, LayoutKind) are typed strings; in JSON they are the
// constants' strings, and an unknown one is ErrInvalidConfig.
//
// # Tensor parallelism
//
// A rank's Layout gives its share of the model's KV heads (KVHeads of
// ModelKVHeads from HeadFirst) and the GPU order (Order): a block's key
// and host bytes are then the same for every TP size (the namespace names
// neither the rank nor the TP size). The ranks' stores write their heads
// into one slot; the block becomes visible when every head is stored, and
// one still missing heads after Config.PartialTimeout (a rank died) is
// reclaimed, never loaded. A load of any TP size copies just its heads
// (token-major tensors move as 2-D copies). The ranks of one process share
// one engine: Engine.Rank returns a RankView for another rank's tensors
// over the same pool, index and copy streams.
//
// # Node pool
//
// Dial(socket, cfg) returns the same Engine over a node pool (package
// nodepool, `kvoffload serve`) instead of a pool of its own: the block
// index and the host memory are the node's, shared by every process of the
// machine that dials it (one per GPU, and a scheduler without a GPU). See
// Dial for what it does differently and what it leaves out.
//
// # What this package builds on, and what it leaves out
//
// The engine composes kvcache (the block index, slots and policy),
// register (pinning), transfer (copies, streams, events and everything
// else that calls the CUDA driver) and mmapmem (regions). It calls the
// driver only through transfer's and register's APIs, and its API exposes
// CUDA events and streams as uintptr values. Test and demo scaffolding is
// not here: the host backend's simulated GPU, an engine attached to one
// (to write and read its "device" memory), and the gating-invariant
// violations live in package offload/hostsim, which tests, the demo and
// the C ABI's kvo_sim_* calls import.
//
// What is pinned when: New maps and pins the staging region
// (Config.StagingBytes) and the first pool region (Config.FirstRegionBytes),
// then returns; the first slots are usable at that point. On CUDA these two
// are mapped untouched and registered with cuMemHostRegister in ranges of
// about 2 GiB (the largest multiple of the slot stride not above
// register.DefaultPipelineChunk), range k+1 prefaulted while range k
// registers; no slot straddles two ranges. The rest of the pool
// (Config.RegionBytes each) is added in the background by a pipeline of
// three stages that each take the regions in order: one maps region i+1 and
// prefaults it whole on its prefault threads, while the growth thread
// registers region i (already resident, so in ranges of up to 64 GiB,
// nothing prefaulted again) and a third stage adds region i-1 to the cache.
// Stores simply find more free slots as regions join. Stats.Pool.FirstSlot and
// Stats.Pool.FullPool report the two times, Stats.Pool.Growth the time of each step;
// PauseGrowth, ResumeGrowth and WaitGrown control and observe growth. On
// CUDA the growth thread calibrates the choice of copy method once growth
// has ended (Stats.Copies.Calibration), so that the calibration does not
// delay the pool nor compete with its prefault for the CPUs; copies issued
// before that use the uncalibrated rule. The calibration times the copies
// on the GPU as it is then: a model running beside it skews the rates it
// compares, so a serving stack calls WaitGrown before its first forward
// pass where it wants the choice made on an idle GPU (bench/realmodel.py
// does). If a stage fails on a region
// (prefault, registration, host ranges, cache), growth stops there: the
// regions before it still join, that region and those after it are
// released, WaitGrown returns the error, Stats.Pool.GrowthError says why, and
// the engine keeps serving from the regions it has. The engine's own threads that call the driver (growth, copy
// submission and completion) set CU_STREAM_CAPTURE_MODE_RELAXED, so a
// graph capture in global mode on one of the stack's threads is not broken
// by them.
//
// Memory goes back to the OS only through Trim, Config.MaxCachedBytes, or
// Close. Trim releases whole regions, newest first; it waits for the copies
// in flight on them, never for leases: a region holding leased blocks is
// reported pending and freed when its last lease ends. Staging buffers
// (Engine.Staging) come from the reserved region and keep their address
// until Close, across any number of Trims, so CUDA graphs can bake them in.
//
// # The serving loop
//
// Keys are 128-bit content hashes chained over a sequence's blocks
// (Engine.Keys, ChainKeys); Python computes the same keys with hashlib.
//
//   - Lookup(keys) returns the length of the longest prefix of keys ready in
//     the pool, optionally with a Lease that keeps those blocks from being
//     evicted until it is released or handed to Load.
//   - Store(ctx, keys, blockIDs, opts) copies GPU blocks to the pool. Pass
//     StoreOptions.After, an event recorded on the stack's stream after the
//     kernels that wrote the blocks; a Store whose AfterStream is capturing
//     a graph is refused with ErrCapturing. Storing a key already present is
//     a no-op reported as already present.
//   - Load(ctx, keys, blockIDs, opts) copies blocks back into GPU blocks. A
//     key evicted since the lookup is reported missing, never an error; keys
//     under a Lease are guaranteed present.
//   - Delete and Clear remove keys; Stats reports everything (cheap, from
//     any goroutine).
//
// No call blocks on the GPU. On the host backend, work beyond the
// in-flight bound (Config.MaxInFlightBytes) waits in a bounded queue
// (Config.MaxQueuedBytes); beyond that a Store reports its blocks
// refused-busy and a Load fails fast with ErrBusy. On CUDA every op carries
// events and is never refused for the bytes in flight: the engine's
// submitting thread issues ops in the order they came, the copy stream is
// their queue (a swap or an eviction is never refused busy). Store and
// Load return before their copies are built: they check, reserve and hand
// the op over, and make no driver call. A cancelled ctx cancels what is
// not yet enqueued, never a copy in flight.
//
// # What an Op guarantees
//
// Store and Load return an Op at once. Every block of the op gets exactly
// one Outcome (stored, already present, refused full/busy/admission,
// failed, cancelled for a Store; loaded, missing, failed, cancelled for a
// Load), and Done is closed once all are final; the Stats outcome counters
// add up to exactly those. A block is visible to Lookup only after its
// store's copy completed; a host slot is reused only after every copy on it
// completed. A copy failure fails only the op it belongs to, with the
// driver's error (Op.Err); blocks stored before stay readable. On CUDA,
// Op.Event (and Op.LayerEvent, for a Load with LoadOptions.PerLayer) is an
// event the stack's stream waits on (Op.StreamWait does the
// cuStreamWaitEvent): after a Store, before overwriting the blocks; after a
// Load, before reading them. Event and LayerEvent block the calling
// thread until the engine has recorded the event asked for, that is,
// until the copies it follows are enqueued (not finished): layer 0's
// first, so a forward waits for the layer it needs next, and a stream
// only ever waits on work already enqueued. No engine thread waits on a
// caller's thread, and nothing on the GPU waits on work a host thread has
// yet to enqueue, so a thread that frees device memory (cudaFree,
// torch.cuda.empty_cache) at any time cannot deadlock the engine.
// LoadOptions.Signal records a caller-owned event as well, for graphs that
// wait on a fixed event. Events stay valid until Op.Release, after which
// the op's methods return ErrReleased.
//
// A sticky driver error (the context is lost) fails the ops in flight, and
// every later Store and Load returns ErrDeviceLost wrapping the driver's
// error. Close the engine.
//
// # Concurrency
//
// Every Engine method, Op method and Lease method is safe for concurrent
// use; the tests run stores, loads, lookups, deletes, Trims and a Close at
// once under the race detector and check that every load returns exactly
// the bytes stored under its key. A block id must not be the destination
// of two Loads in flight at once, nor be overwritten by the stack while a
// Store of it is in flight: the engine orders its copies with the events
// it is given and gives, not with the stack's other work.
//
// # Privacy of the pool
//
// KV blocks are users' prompts. The pool and staging regions are private
// anonymous memory: never a file, nothing under /dev/shm, no memfd that
// another process could open through /proc/PID/fd; pinned (registered, or
// PinMlock on the host backend) so never swapped out; MADV_DONTDUMP keeps
// them out of core dumps and MADV_DONTFORK out of a fork's child. Anonymous
// rather than memfd-backed on purpose: memfd memory is shmem, whose
// transparent huge pages are governed by shmem_enabled, "never" on most
// distributions, and losing them about doubles prefault+pin time and
// multiplies the pages the driver pins; a memfd would add a
// shareable handle and nothing private. Config.ZeroOnRelease zeroes a
// slot when its block is evicted, deleted or cleared, after its last copy
// and reader ended and before the slot is reused (trimmed regions go back
// to the OS, which zeroes pages before reuse); it costs a memset of the
// block on the releasing call, done outside the cache's lock so other calls
// do not wait for it (BenchmarkZeroOnRelease, BenchmarkZeroOnReleaseContention). No error or log of
// the engine contains block contents: they name keys (hashes), block ids,
// sizes and addresses only.
//
// Close refuses new calls (ErrClosed), waits for the copies in flight,
// ends leases, then unpins and unmaps everything, staging included. Ops
// stay readable after Close; their events are gone. CloseContext bounds
// the wait (a device whose events never complete): the engine is closed at
// once and releases its memory in the background when the copies end.
package offload
