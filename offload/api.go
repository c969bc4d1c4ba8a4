package offload

import (
	"errors"
	"strconv"
	"time"

	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/kvoffload/kvoffload/transfer"
)

// Errors wrap one of these or a driver error, naming the bad value and
// limit.
var (
	ErrClosed             = errors.New("offload: engine closed")
	ErrReleased           = errors.New("offload: op or lease already released")
	ErrBusy               = errors.New("offload: engine busy")                  // no room to queue a Load (a Store reports OutcomeRefusedBusy)
	ErrNoDriver           = cudadev.ErrNoDriver                                 // no libcuda.so.1 or device, or CGO_ENABLED=0
	ErrPoolTooSmall       = errors.New("offload: pool too small")               // not one block
	ErrInsufficientMemory = errors.New("offload: insufficient memory for pool") // MemAvailable, cgroup, RLIMIT_MEMLOCK or NUMA node
	ErrInvalidConfig      = errors.New("offload: invalid config")
	ErrInvalidArgument    = errors.New("offload: invalid argument")    // the call did nothing
	ErrCapturing          = errors.New("offload: stream is capturing") // StoreOptions.AfterStream is capturing a CUDA graph
	ErrDeviceLost         = errors.New("offload: device lost")         // a sticky driver error: close the engine
	ErrNotDone            = errors.New("offload: op not done")
	ErrGrowth             = errors.New("offload: background growth stopped") // WaitGrown; GrowTo tries again
	ErrUnavailable        = errors.New("offload: node unavailable")          // Dial's node gone: Lookup finds nothing, Store refuses busy
)

// Backend is auto (the default: CUDA if possible, else host), cuda or host.
type Backend string

// HostPinning is how the host backend pins regions: none (default) or mlock.
type HostPinning string

// HugePages is the regions' page size: THP (the default), none or hugetlbfs.
type HugePages string

// Policy is the admission and eviction policy: LRU (the default) or TinyLFU.
type Policy string

// NUMA settings (Config.NUMANode) besides a decimal node number.
const (
	numaAuto = "auto"
	numaNone = "none"
)

// LayoutKind is the tensors' arrangement: K and V per layer (LayerTensors),
// one tensor of whole blocks (Base, Stride), or an MLA latent per layer.
type LayoutKind string

// HeadOrder is a block's device order: token-major [blocks, tokens, heads,
// head_dim], head-major [blocks, heads, tokens, head_dim]; "" undeclared.
type HeadOrder string

// Defaults applied by New to zero fields.
const (
	defaultFirstRegionBytes   int64 = 1 << 30 // pinned before New returns: small enough that New is quick, large enough to serve at once
	defaultRegionBytes        int64 = 4 << 30 // unit of background growth and Trim
	defaultStagingBytes       int64 = 16 << 20
	defaultMaxInFlightBytes   int64 = 512 << 20
	defaultMaxQueuedBytes     int64 = 2 << 30
	defaultQueueDepth               = 256
	defaultMaxPrefaultThreads       = 16
	// defaultMemoryHeadroomBytes is the memory growth leaves free for
	// the rest of the machine: before mapping each region, growth checks
	// that the region plus this much is still available, and stops with
	// Stats.Pool.GrowthError otherwise, instead of pinning into an OOM kill.
	defaultMemoryHeadroomBytes int64 = 2 << 30
)

// Config says what New builds (JSON-ready); a zero field takes its default.
type Config struct {
	PoolBytes           int64          `json:"pool_bytes"` // exact size of the pool; required
	Layout              LayoutSpec     `json:"layout"`     // the stack's GPU KV cache; required
	Backend             Backend        `json:"backend,omitempty"`
	Device              int            `json:"device,omitempty"`             // CUDA device ordinal
	Namespace           string         `json:"namespace,omitempty"`          // model and dtype (and TP rank and size without Layout.Order): keys, Clear
	Policy              Policy         `json:"policy,omitempty"`             // default PolicyLRU
	FirstRegionBytes    int64          `json:"first_region_bytes,omitempty"` // pinned by New (1 GiB)
	RegionBytes         int64          `json:"region_bytes,omitempty"`       // the unit of growth and Trim (4 GiB)
	StagingBytes        int64          `json:"staging_bytes,omitempty"`      // Staging's region (16 MiB; negative: none)
	MaxCachedBytes      int64          `json:"max_cached_bytes,omitempty"`   // a cap on growth when positive
	HostPinning         HostPinning    `json:"host_pinning,omitempty"`       // host backend only
	HugePages           HugePages      `json:"huge_pages,omitempty"`
	NUMANode            string         `json:"numa_node,omitempty"`             // "auto" (the GPU's), "none" or a node number
	PrefaultThreads     int            `json:"prefault_threads,omitempty"`      // default min(NumCPU, 16)
	PrefaultNice        int            `json:"prefault_nice,omitempty"`         // their nice (≤ 19; 0: 10 on ≤ 4 CPUs, else none; < 0: none)
	MemoryHeadroomBytes int64          `json:"memory_headroom_bytes,omitempty"` // left free by growth (2 GiB; negative: none)
	SkipMemoryCheck     bool           `json:"skip_memory_check,omitempty"`     // no sizing checks before pinning
	MaxInFlightBytes    int64          `json:"max_in_flight_bytes,omitempty"`   // host backend: copied at once per direction (512 MiB)
	MaxQueuedBytes      int64          `json:"max_queued_bytes,omitempty"`      // and waiting beyond (2 GiB), past which ops are refused
	MaxDeviceBytes      int64          `json:"max_device_bytes,omitempty"`      // the CUDA copy layer's GPU memory (256 MiB)
	PartialTimeout      time.Duration  `json:"partial_timeout,omitempty"`       // a head-range block's wait for its heads (30 s; JSON: ns)
	ZeroOnRelease       bool           `json:"zero_on_release,omitempty"`       // zero a block's slot and record when it leaves
	Disk                *DiskConfig    `json:"disk,omitempty"`                  // the disk tier; nil: none
	Cluster             *ClusterConfig `json:"cluster,omitempty"`               // the cluster tier; nil: none
	// Package hostsim's seam: the host backend's device (nil: new), disk faults.
	HostDevice transfer.Device            `json:"-"`
	DiskFaults func(op, dir string) error `json:"-"`
}

// LayoutSpec describes the stack's GPU KV cache at its device addresses.
type LayoutSpec struct {
	Kind           LayoutKind     `json:"kind"`
	Layers         int            `json:"layers"`
	KVHeads        int            `json:"kv_heads"`                 // the heads the tensors hold (1 for MLA)
	ModelKVHeads   int            `json:"model_kv_heads,omitempty"` // the model's, when a TP rank holds [HeadFirst, HeadFirst+KVHeads)
	HeadFirst      int            `json:"head_first,omitempty"`
	Order          HeadOrder      `json:"order,omitempty"` // declared: slots shared by every TP size and order
	HeadDim        int            `json:"head_dim"`        // elements per head (the latent width for MLA)
	DTypeBytes     int            `json:"dtype_bytes"`     // 2 for bf16
	TokensPerBlock int            `json:"tokens_per_block"`
	NumBlocks      int            `json:"num_blocks"`              // block ids are 0..NumBlocks-1
	LayerTensors   []LayerTensors `json:"layer_tensors,omitempty"` // per layer; none: allocated by the host backend
	Base           uint64         `json:"base,omitempty"`          // cross-layer: block b at Base + b*Stride
	Stride         uint64         `json:"stride,omitempty"`
}

// LayerTensors locates a layer: block b's K is at K+b*Stride, V at
// V+b*Stride.
type LayerTensors struct {
	K      uint64 `json:"k"`
	V      uint64 `json:"v,omitempty"`
	Stride uint64 `json:"stride"`
}

// Outcome is what happened to one block of an op: one final outcome each.
type Outcome uint8

const (
	OutcomePending          Outcome = iota // the op is not done
	OutcomeStored                          // copied and visible to lookups
	OutcomeAlreadyPresent                  // stored (or being stored) before
	OutcomeRefusedFull                     // no free slot (a leased block is never evicted)
	OutcomeRefusedBusy                     // the queue for in-flight room was full
	OutcomeRefusedAdmission                // the policy declined the key
	OutcomeFailed                          // the copy failed (Op.Err)
	OutcomeLoaded                          // copied into the caller's block
	OutcomeMissing                         // not in the pool (evicted since the lookup)
	OutcomeCancelled                       // ctx ended before the copy was enqueued
)

const numOutcomes = OutcomeCancelled + 1

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
	Lease bool // lease the blocks found: not evicted until released or loaded
}

// LookupResult is the answer of Lookup.
type LookupResult struct {
	Hits, DiskHits int    // the longest prefix of keys ready in the pool; keys after it on disk (unleased)
	Lease          *Lease // on keys[:Hits] with LookupOptions.Lease; release it or pass it to Load
}

// StoreOptions modify Store.
type StoreOptions struct {
	After, AfterStream uintptr  // an event after the kernels writing the blocks (0: none), and its stream
	Namespace          string   // tags the blocks for Clear; default Config.Namespace
	Parent             Key      // the key before keys[0] (zero: a sequence's start); eviction takes tails first
	Parents            []Key    // one parent per key, for blocks of several sequences
	Tokens             []uint32 // optional: the blocks' token ids, for their EventStored
}

// LoadOptions modify Load.
type LoadOptions struct {
	Lease    *Lease  // from Lookup, on a prefix of the keys; Load takes it over
	After    uintptr // an event after which the destination blocks may be overwritten
	PerLayer bool    // one event per layer (Op.LayerEvent)
	Signal   uintptr // a caller's event also recorded after the copies (CUDA graphs)
}

// TrimResult reports what Trim gave back.
type TrimResult struct {
	RequestedBytes int64 `json:"requested_bytes"`
	FreedBytes     int64 `json:"freed_bytes"`
	PendingBytes   int64 `json:"pending_bytes"` // freed when their regions' last leases end
	Regions        int   `json:"regions"`       // freed or pending
	EvictedBlocks  int   `json:"evicted_blocks"`
}

// Backend returns the backend in use and why it was picked.
func (e *Engine) Backend() (name Backend, reason string) { return e.backend, e.backendReason }
