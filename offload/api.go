package offload

import (
	"errors"
	"strconv"
	"time"

	"github.com/kvoffload/kvoffload/transfer"
)

// Sentinel errors callers branch on (errors.Is). Every error the package
// returns wraps one of these or a driver error, and names the bad value and
// the limit it broke.
var (
	// ErrClosed: the engine was closed; no call after Close does anything.
	ErrClosed = errors.New("offload: engine closed")
	// ErrReleased: the Op or Lease was released and must not be used again.
	ErrReleased = errors.New("offload: op or lease already released")
	// ErrBusy: the bounded queue of work waiting for in-flight room is full.
	// A Load fails fast with it; a Store reports OutcomeRefusedBusy per block
	// instead.
	ErrBusy = errors.New("offload: engine busy")
	// ErrNoDriver: the CUDA backend was asked for but libcuda.so.1 (or a
	// device) is not available, or the module was built with CGO_ENABLED=0.
	ErrNoDriver = transfer.ErrNoDriver
	// ErrPoolTooSmall: the configured pool cannot hold a single block.
	ErrPoolTooSmall = errors.New("offload: pool too small")
	// ErrInsufficientMemory: the machine (MemAvailable, the cgroup's memory
	// limit, RLIMIT_MEMLOCK or the NUMA node's free memory) cannot hold the
	// requested pool; the message says how much is available.
	ErrInsufficientMemory = errors.New("offload: insufficient memory for pool")
	// ErrInvalidConfig: a Config field is out of range or unknown.
	ErrInvalidConfig = errors.New("offload: invalid config")
	// ErrInvalidArgument: bad input to a call (length mismatch, block id
	// outside the layout, duplicate key, negative size...).
	ErrInvalidArgument = errors.New("offload: invalid argument")
	// ErrCapturing: a stream passed as StoreOptions.AfterStream is being
	// captured into a CUDA graph; a Store cannot be part of a graph.
	ErrCapturing = errors.New("offload: stream is capturing")
	// ErrDeviceLost: a sticky driver error (or an unusable device): the
	// engine refuses all new Store and Load calls; the error wraps the
	// driver's. Close the engine.
	ErrDeviceLost = errors.New("offload: device lost")
	// ErrNotDone: Outcomes was called before the op completed.
	ErrNotDone = errors.New("offload: op not done")
	// ErrGrowth: background growth stopped on an error (WaitGrown); the
	// engine keeps serving from the regions it has. GrowTo tries again.
	ErrGrowth = errors.New("offload: background growth stopped")
)

// Backend is a backend's name: accepted by Config.Backend and reported by
// Engine.Backend. In JSON it is the constant's string; "" (or no field)
// means the default.
type Backend string

// Backends.
const (
	BackendAuto Backend = "auto" // CUDA when libcuda loads and the device exists, else host
	BackendCUDA Backend = "cuda" // cuMemHostRegister'd pool, copies on the GPU
	BackendHost Backend = "host" // no GPU: copies by goroutines between host addresses
)

// HostPinning is how the host backend pins its regions (Config.HostPinning).
type HostPinning string

// Host pinning modes.
const (
	PinNone  HostPinning = "none"  // pages are only prefaulted (default)
	PinMlock HostPinning = "mlock" // mlock(2) each region; bounded by RLIMIT_MEMLOCK
)

// HugePages is the page size regions are mapped with (Config.HugePages).
type HugePages string

// Huge page modes.
const (
	HugePagesTHP     HugePages = "thp"     // madvise(MADV_HUGEPAGE) (default)
	HugePagesNone    HugePages = "none"    // 4 KiB pages
	HugePagesHugeTLB HugePages = "hugetlb" // MAP_HUGETLB from the hugetlbfs pool
)

// Policy is the admission and eviction policy (Config.Policy).
type Policy string

// Policies.
const (
	PolicyTinyLFU Policy = "tinylfu" // ristretto TinyLFU admission + sampled LFU eviction
	PolicyLRU     Policy = "lru"     // exact least-recently-used, admits everything (default)
)

// NUMA settings (Config.NUMANode) besides a decimal node number.
const (
	NUMAAuto = "auto" // the GPU's own node from sysfs (default); no binding on the host backend
	NUMANone = "none" // no binding
)

// LayoutKind is how the stack's KV cache tensors are arranged
// (LayoutSpec.Kind).
type LayoutKind string

// Layout kinds.
const (
	// LayoutLayerSeparate: one K and one V tensor per layer, each indexed by
	// block id (vLLM's classic layout); LayerTensors has Layers entries.
	LayoutLayerSeparate LayoutKind = "layer-separate"
	// LayoutCrossLayer: one tensor whose block holds all layers' K and V
	// contiguously; Base and Stride locate it.
	LayoutCrossLayer LayoutKind = "cross-layer"
	// LayoutMLA: one latent tensor per layer (DeepSeek MLA), KVHeads = 1 and
	// HeadDim = the latent width; LayerTensors has Layers entries, V = 0.
	LayoutMLA LayoutKind = "mla"
)

// HeadOrder is the device order of a block's tokens and heads
// (LayoutSpec.Order). In JSON it is the constant's string.
type HeadOrder string

// Head orders; "" is undeclared.
const (
	OrderTokenMajor HeadOrder = "token-major"
	OrderHeadMajor  HeadOrder = "head-major"
)

// Defaults applied by New to zero fields.
const (
	DefaultFirstRegionBytes   int64 = 1 << 30 // pinned before New returns: small enough that New is quick, large enough to serve at once
	DefaultRegionBytes        int64 = 4 << 30 // unit of background growth and Trim
	DefaultStagingBytes       int64 = 16 << 20
	DefaultMaxInFlightBytes   int64 = 512 << 20
	DefaultMaxQueuedBytes     int64 = 2 << 30
	DefaultQueueDepth               = 256
	DefaultMaxPrefaultThreads       = 16
	// DefaultMemoryHeadroomBytes is the memory growth leaves free for
	// the rest of the machine: before mapping each region, growth checks
	// that the region plus this much is still available, and stops with
	// Stats.GrowthError otherwise, instead of pinning into an OOM kill.
	DefaultMemoryHeadroomBytes int64 = 2 << 30
)

// Config says what New builds. The zero value of every field but PoolBytes
// and Layout means "the default"; the defaults suit a GPU serving machine
// with tens to hundreds of GiB of host memory.
// It is plain data with JSON tags so that the C ABI and the CLI can pass it
// as JSON.
type Config struct {
	// PoolBytes is the exact size in bytes of the host pool for KV slots
	// (rounded up to the page size only, never to a power of two). Required;
	// must hold at least one block.
	PoolBytes int64 `json:"pool_bytes"`
	// FirstRegionBytes is the size in bytes of the region pinned before New
	// returns (the first usable slots). Default DefaultFirstRegionBytes, or
	// PoolBytes when smaller.
	FirstRegionBytes int64 `json:"first_region_bytes,omitempty"`
	// RegionBytes is the size in bytes of each later region, pinned in the
	// background; the unit of Trim. Default DefaultRegionBytes.
	RegionBytes int64 `json:"region_bytes,omitempty"`
	// StagingBytes is the size in bytes of the reserved region Staging
	// buffers are carved from, pinned in New and never trimmed.
	// Default DefaultStagingBytes; negative means none.
	StagingBytes int64 `json:"staging_bytes,omitempty"`
	// Layout is the serving stack's GPU KV cache. Required.
	Layout LayoutSpec `json:"layout"`
	// Backend is BackendAuto (default), BackendCUDA or BackendHost.
	Backend Backend `json:"backend,omitempty"`
	// HostPinning is PinNone (default) or PinMlock; host backend only.
	HostPinning HostPinning `json:"host_pinning,omitempty"`
	// Device is the CUDA device ordinal (default 0).
	Device int `json:"device,omitempty"`
	// HugePages is HugePagesTHP (default), HugePagesNone or HugePagesHugeTLB.
	HugePages HugePages `json:"huge_pages,omitempty"`
	// NUMANode is NUMAAuto (default: the GPU's own node, from
	// /sys/bus/pci/devices/<bus id>/numa_node; none when sysfs says -1),
	// NUMANone, or a decimal node number to bind the pool to.
	NUMANode string `json:"numa_node,omitempty"`
	// PrefaultThreads is the number of threads touching a region's pages
	// before it is pinned. Default min(NumCPU, DefaultMaxPrefaultThreads).
	PrefaultThreads int `json:"prefault_threads,omitempty"`
	// PrefaultNice is added to the prefault threads' nice value, so that
	// on a machine whose CPUs are busy growth yields to the serving loop.
	// 0 means mmapmem.DefaultPrefaultNice() (10 on machines of at most 4
	// CPUs, none on larger ones); negative keeps the caller's
	// priority; above 19 is ErrInvalidConfig.
	PrefaultNice int `json:"prefault_nice,omitempty"`
	// Policy is PolicyLRU (default) or PolicyTinyLFU. LRU is the default:
	// on kvcache's synthetic serving trace (BenchmarkHitRatio) TinyLFU hit
	// no more often, wasted many of its store copies on blocks it rejected
	// after the copy, and costs several times LRU's CPU per block
	// (bench/results/README.md).
	Policy Policy `json:"policy,omitempty"`
	// MaxInFlightBytes bounds the bytes being copied per direction; work
	// beyond it waits in the queue (host backend). An op with events (every
	// op on CUDA) is issued at once and never refused for it: its stream is
	// its queue. Default DefaultMaxInFlightBytes.
	MaxInFlightBytes int64 `json:"max_in_flight_bytes,omitempty"`
	// MaxQueuedBytes bounds the bytes waiting for in-flight room per
	// direction; beyond it a Store is refused (OutcomeRefusedBusy) and a
	// Load fails with ErrBusy. Default DefaultMaxQueuedBytes.
	MaxQueuedBytes int64 `json:"max_queued_bytes,omitempty"`
	// Namespace is mixed into the keys Engine.Keys makes (model, dtype,
	// layout) and tags stored blocks for Clear. With a declared
	// Layout.Order it must not name the tensor-parallel rank or size:
	// every rank and every TP size shares the blocks (a slot holds all of
	// the model's heads). Without one, a slot holds one rank's device
	// bytes, and the namespace must name the rank and the TP size.
	Namespace string `json:"namespace,omitempty"`
	// MaxCachedBytes, when positive, is a bound on the pool bytes ever
	// pinned: growth stops there (the pool is planned up to it, not up to
	// PoolBytes), and GrowTo never asks beyond it. 0 means no bound.
	MaxCachedBytes int64 `json:"max_cached_bytes,omitempty"`
	// PartialTimeout bounds how long a block stored by head ranges (the
	// ranks of a tensor-parallel group, Layout.ModelKVHeads) waits for
	// its missing heads: a block still partial this long after its first
	// rank's store began (a rank died, or its store failed) is reclaimed,
	// never loaded (Stats.PartialExpired). Stores and the engine's idle
	// path check it. Default kvcache.DefaultPartialTimeout (30 s);
	// negative is ErrInvalidConfig. In JSON: nanoseconds.
	PartialTimeout time.Duration `json:"partial_timeout,omitempty"`
	// MemoryHeadroomBytes is kept free when growth re-checks the machine's
	// memory before each region (MemAvailable, the cgroup limit, the NUMA
	// node's free memory, as New checks the whole pool). Default
	// DefaultMemoryHeadroomBytes; negative means none. SkipMemoryCheck
	// skips the re-check too.
	MemoryHeadroomBytes int64 `json:"memory_headroom_bytes,omitempty"`
	// ZeroOnRelease zeroes a slot's bytes when its block is evicted or
	// deleted, so that no KV of a past request stays in host memory. With
	// a disk tier it reaches the disk too (tier/disk's ZeroOnRelease): a
	// record deleted or cleared is punched out of its file (zeros written
	// where the file system cannot punch), an evicted one is overwritten.
	ZeroOnRelease bool `json:"zero_on_release,omitempty"`
	// GreedyStores (CUDA backend) runs stores on the copy kernel's
	// unthrottled launch (transfer.CUDAOptions.GreedyStores): small
	// segments move a little faster, but the backlog of posted writes to
	// host memory slows a compute-bound kernel running beside the stores
	// several times (the fence sweep in bench/results/README.md). Leave it
	// off while the model's kernels run.
	GreedyStores bool `json:"greedy_stores,omitempty"`
	// MaxDeviceBytes (CUDA backend) bounds the GPU memory the copy layer
	// allocates beside the serving stack's: descriptor tables, the bounce
	// chunks of bounced copies and, while it runs, the calibration buffer.
	// 0 means transfer.DefaultMaxDeviceBytes (256 MiB: three bounced copies
	// per direction in flight with their full rings of bounce chunks, and
	// the calibration buffer beside them). A copy short of it waits for
	// earlier copies to complete and reuses their memory; one that could
	// never fit is split. The engine allocates about all of it by the end
	// of growth (tables and idle bounce chunks, kept for the first ops: see
	// doc/DESIGN.md, warm start) and keeps it until Close. Negative, or
	// below one descriptor table and one bounce chunk
	// (transfer.MinDeviceBytes, 10 MiB), is ErrInvalidConfig.
	MaxDeviceBytes int64 `json:"max_device_bytes,omitempty"`
	// SkipMemoryCheck disables the safe-sizing check (MemAvailable, cgroup
	// limit, RLIMIT_MEMLOCK, NUMA node free memory) done before pinning.
	SkipMemoryCheck bool `json:"skip_memory_check,omitempty"`
	// Disk, when set, adds the disk tier below the host pool (see
	// DiskConfig): evicted blocks are written back to it, Lookup reports
	// the blocks found on it (LookupResult.DiskHits), Load promotes them.
	// Nil: no disk tier.
	Disk *DiskConfig `json:"disk,omitempty"`
	// Cluster, when set, adds the cluster tier (see ClusterConfig): blocks
	// stored are written through to a Redis Cluster, and Prefetch promotes
	// blocks other engines wrote there. A cluster that does not answer at
	// New leaves the engine without the tier (Stats.ClusterError). Nil: no
	// cluster tier.
	Cluster *ClusterConfig `json:"cluster,omitempty"`
}

// LayoutSpec describes the serving stack's GPU KV cache as plain data (it
// mirrors kvcache.LayoutSpec). Addresses are CUDA device addresses on the
// CUDA backend and simulated-device addresses (package hostsim) on the host
// backend; on the host backend a layout without tensors is allocated densely
// in the engine's simulated device.
type LayoutSpec struct {
	// Kind is LayoutLayerSeparate, LayoutCrossLayer or LayoutMLA.
	Kind LayoutKind `json:"kind"`
	// Layers is the number of attention layers.
	Layers int `json:"layers"`
	// KVHeads is the number of KV heads the device tensors hold: the
	// rank's, [HeadFirst, HeadFirst+KVHeads) of the model's ModelKVHeads;
	// 1 for MLA.
	KVHeads int `json:"kv_heads"`
	// ModelKVHeads is the model's KV heads (every tensor-parallel rank
	// together). 0 means KVHeads: the tensors hold every head (one rank,
	// or heads the ranks replicate, as MLA's latent). A block's key and
	// host bytes are then the same for every TP size: ranks store their
	// heads into one slot (visible once every head is stored) and any TP
	// size loads its own heads (see Engine.Rank). Needs Order when the
	// rank holds fewer heads than the model.
	ModelKVHeads int `json:"model_kv_heads,omitempty"`
	// HeadFirst is the model's first KV head the tensors hold (the rank's
	// head range is [HeadFirst, HeadFirst+KVHeads)); 0 without
	// ModelKVHeads.
	HeadFirst int `json:"head_first,omitempty"`
	// Order is how a block's tokens and heads sit in one layer's K (or V)
	// on the GPU: OrderTokenMajor ([blocks, tokens, heads, head_dim],
	// vLLM's and transformers' paged caches), OrderHeadMajor ([blocks,
	// heads, tokens, head_dim]), or "" (undeclared: the host slot is a
	// byte copy of the device's block, as in every release before head
	// ranges, shared only by engines of the same device order and TP
	// size). A declared order makes the host slot head-major: the same
	// bytes for every TP size and order (head-major).
	Order HeadOrder `json:"order,omitempty"`
	// HeadDim is the width of one head in elements (the latent width for MLA).
	HeadDim int `json:"head_dim"`
	// DTypeBytes is the size of one element in bytes (2 for bf16).
	DTypeBytes int `json:"dtype_bytes"`
	// TokensPerBlock is the number of tokens per block (typically 16).
	TokensPerBlock int `json:"tokens_per_block"`
	// NumBlocks is the number of blocks in the GPU cache; valid block ids
	// are 0..NumBlocks-1.
	NumBlocks int `json:"num_blocks"`
	// LayerTensors: one entry per layer for LayoutLayerSeparate and
	// LayoutMLA (V = 0 for MLA).
	LayerTensors []LayerTensors `json:"layer_tensors,omitempty"`
	// Base and Stride: for LayoutCrossLayer, block b is at Base + b*Stride.
	Base   uint64 `json:"base,omitempty"`
	Stride uint64 `json:"stride,omitempty"`
}

// LayerTensors locates one layer's tensors: block b's K is at K + b*Stride
// and its V at V + b*Stride (see kvcache.LayerTensors for one tensor holding
// both K and V).
type LayerTensors struct {
	K      uint64 `json:"k"`
	V      uint64 `json:"v,omitempty"`
	Stride uint64 `json:"stride"`
}

// Outcome is what happened to one block of an op. Every block of every op
// has exactly one final outcome; OutcomePending only before the op is done.
type Outcome uint8

// Outcomes of Store (Stored, AlreadyPresent, Refused*, Failed, Cancelled)
// and Load (Loaded, Missing, Failed, Cancelled).
const (
	OutcomePending          Outcome = iota // not decided yet
	OutcomeStored                          // copied to the host pool and visible to lookups
	OutcomeAlreadyPresent                  // the key was already stored (or being stored)
	OutcomeRefusedFull                     // no free slot (never evicts a leased block, a write-through's to the cluster not yet copied included; never waits)
	OutcomeRefusedBusy                     // the queue for in-flight room was full
	OutcomeRefusedAdmission                // the policy declined the key
	OutcomeFailed                          // the copy failed (see Op.Err)
	OutcomeLoaded                          // copied back into the caller's block
	OutcomeMissing                         // not in the pool (evicted since the lookup)
	OutcomeCancelled                       // the context ended before the copy was enqueued
	numOutcomes
)

var outcomeNames = [numOutcomes]string{
	"pending", "stored", "already-present", "refused-full", "refused-busy",
	"refused-admission", "failed", "loaded", "missing", "cancelled",
}

// String returns the outcome's name, e.g. "refused-full".
func (o Outcome) String() string {
	if o < numOutcomes {
		return outcomeNames[o]
	}
	return "outcome(" + strconv.Itoa(int(o)) + ")"
}

// LookupOptions modify Lookup.
type LookupOptions struct {
	// Lease takes a reader lease on the blocks found, so that they cannot be
	// evicted until the lease is released or passed to Load.
	Lease bool
}

// LookupResult is the answer of Lookup.
type LookupResult struct {
	// Hits is the length of the longest prefix of keys whose blocks are
	// ready in the pool.
	Hits int
	// DiskHits is the number of keys after that prefix whose blocks have a
	// record in the disk tier (Config.Disk): keys[Hits:Hits+DiskHits] can
	// be loaded too, Load promoting them through host slots. It is answered
	// from memory (never waits for the disk) and leases nothing: such a
	// block may vanish or turn out damaged before the Load, which then
	// reports it missing.
	DiskHits int
	// Lease holds reader leases on keys[:Hits] when LookupOptions.Lease was
	// set and Hits > 0; nil otherwise. Release it, or pass it to Load.
	Lease *Lease
}

// StoreOptions modify Store.
type StoreOptions struct {
	// After is a CUevent the caller recorded on its stream after the kernels
	// that wrote the blocks; the copies wait on its most recent record (at
	// the time they are issued). 0: no wait (the caller guarantees the blocks
	// are already written). On the host backend it is an event of the
	// simulated device (package hostsim).
	After uintptr
	// AfterStream is the stream After was recorded on, optional: when given
	// and it is capturing a CUDA graph, the Store is refused with
	// ErrCapturing and nothing is stored. The check runs on the calling
	// goroutine's OS thread, which must have the CUDA context current.
	AfterStream uintptr
	// Namespace tags the stored blocks for Clear; default Config.Namespace.
	Namespace string
	// Parent is the key of the block before keys[0] when the call's keys
	// are one chain (one sequence's blocks, in order): a sequence stored
	// over several calls (decode adds a block at a time) stays one chain,
	// so eviction takes its tail, never its middle. The zero Key: keys[0]
	// starts a sequence. keys[i-1] is the parent of keys[i].
	Parent Key
	// Parents, for a call holding blocks of several sequences, gives one
	// parent per key (the zero Key starts a sequence); it replaces Parent,
	// and must have len(keys) entries. A key whose parent is refused in
	// the same call is refused the same way, as within one chain.
	Parents []Key
	// Tokens, optional, are the token ids of the blocks stored,
	// TokensPerBlock per key in key order (len(keys) × TokensPerBlock):
	// they go into the blocks' EventStored (Engine.Events), since routers
	// hash tokens themselves. Nil: events carry no tokens.
	Tokens []uint32
}

// LoadOptions modify Load.
type LoadOptions struct {
	// Lease, from Lookup, guarantees its keys are loaded: its keys must be
	// a prefix of the keys loaded, and they are copied from the leased
	// slots even if Trim, Delete or Clear removed them from the pool since
	// (the lease kept their bytes). When Load returns an op it has taken
	// the lease over (the op holds the slots until its copies are done, and
	// Lease.Release returns ErrReleased); when Load returns an error the
	// lease is still the caller's. Keys after the leased prefix are looked
	// up at the time of the Load.
	Lease *Lease
	// After is a CUevent after which the destination GPU blocks may be
	// overwritten (their previous readers are done). 0: no wait.
	After uintptr
	// PerLayer records one event per layer (layer-separate and MLA layouts),
	// so that attention on layer 0 can start while later layers load.
	PerLayer bool
	// Signal is a caller-owned CUevent recorded on the engine's stream after
	// the load's copies, in addition to the op's own event (for CUDA graphs
	// whose external event-wait node waits on a fixed event). A Load that
	// copies nothing (every key missing) does not record it. The caller may
	// wait on it as soon as Load returns, so a Load with a Signal returns
	// once its copies are enqueued and the Signal recorded (a Load without
	// one returns before). 0: none. On the host backend it is an
	// event of the simulated device (package hostsim).
	Signal uintptr
}

// TrimResult reports what Trim gave back.
type TrimResult struct {
	// RequestedBytes is the argument of Trim.
	RequestedBytes int64 `json:"requested_bytes"`
	// FreedBytes were unregistered and unmapped by this call.
	FreedBytes int64 `json:"freed_bytes"`
	// PendingBytes are in regions that will be freed when their last
	// leases end.
	PendingBytes int64 `json:"pending_bytes"`
	// Regions is the number of regions freed or pending.
	Regions int `json:"regions"`
	// EvictedBlocks is the number of blocks evicted from those regions.
	EvictedBlocks int `json:"evicted_blocks"`
}

// Backend returns the backend in use (BackendCUDA or BackendHost) and why it
// was picked.
func (e *Engine) Backend() (name Backend, reason string) { return e.backend, e.backendReason }
