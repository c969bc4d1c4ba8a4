package offload

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"strconv"

	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/kvoffload/kvoffload/kvcache"
)

// numaSetting is Config.NUMANode parsed.
type numaSetting struct {
	auto bool
	node int // -1: none
}

// withDefaults returns cfg with every zero field set to its default and
// checks every field; errors wrap ErrInvalidConfig and name the field, the
// bad value and the limit.
// It returns the slot size (bytes of one block). A layout without tensors
// (allowed on the host backend, which then allocates them) is checked with
// its dense placement.
func withDefaults(cfg Config) (Config, numaSetting, int64, error) {
	bad := func(format string, args ...any) (Config, numaSetting, int64, error) {
		return Config{}, numaSetting{}, 0, fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	if cfg.PoolBytes <= 0 {
		return bad("PoolBytes = %d, must be at least one block", cfg.PoolBytes)
	}
	if cfg.FirstRegionBytes < 0 || cfg.RegionBytes < 0 {
		return bad("FirstRegionBytes = %d, RegionBytes = %d: must not be negative", cfg.FirstRegionBytes, cfg.RegionBytes)
	}
	if cfg.RegionBytes == 0 {
		cfg.RegionBytes = defaultRegionBytes
	}
	switch {
	case cfg.MemoryHeadroomBytes == 0:
		cfg.MemoryHeadroomBytes = defaultMemoryHeadroomBytes
	case cfg.MemoryHeadroomBytes < 0:
		cfg.MemoryHeadroomBytes = 0
	}
	if cfg.PrefaultNice > 19 {
		return bad("PrefaultNice = %d: at most 19 (the lowest priority); negative keeps the caller's", cfg.PrefaultNice)
	}
	if cfg.MaxDeviceBytes < 0 {
		return bad("MaxDeviceBytes = %d, must not be negative (0: the default %d)", cfg.MaxDeviceBytes, cudadev.DefaultMaxDeviceBytes)
	}
	if m := cudadev.MinDeviceBytes(); cfg.MaxDeviceBytes > 0 && cfg.MaxDeviceBytes < m {
		return bad("MaxDeviceBytes = %d is below the minimum %d (one descriptor table and one staging chunk)", cfg.MaxDeviceBytes, m)
	}
	if cfg.FirstRegionBytes == 0 {
		cfg.FirstRegionBytes = defaultFirstRegionBytes
	}
	cfg.FirstRegionBytes = min(cfg.FirstRegionBytes, cfg.PoolBytes)
	switch {
	case cfg.StagingBytes == 0:
		cfg.StagingBytes = defaultStagingBytes
	case cfg.StagingBytes < 0:
		cfg.StagingBytes = -1
	}
	if _, ok := addSizes(cfg.PoolBytes, max(cfg.StagingBytes, 0)); !ok {
		return bad("PoolBytes = %d plus StagingBytes = %d overflows int64 (at most %d)", cfg.PoolBytes, cfg.StagingBytes, int64(math.MaxInt64))
	}
	if cfg.Backend == "" {
		cfg.Backend = BackendAuto
	}
	if cfg.HostPinning == "" {
		cfg.HostPinning = PinNone
	}
	if cfg.HugePages == "" {
		cfg.HugePages = HugePagesTHP
	}
	if cfg.Policy == "" {
		cfg.Policy = PolicyLRU
	}
	if err := errors.Join(checkEnum("Backend", cfg.Backend, backends), checkEnum("HostPinning", cfg.HostPinning, pinnings),
		checkEnum("HugePages", cfg.HugePages, hugePages), checkEnum("Policy", cfg.Policy, policies)); err != nil {
		return Config{}, numaSetting{}, 0, err
	}
	if cfg.Device < 0 {
		return bad("Device = %d: must not be negative", cfg.Device)
	}
	var numa numaSetting
	switch cfg.NUMANode {
	case "", numaAuto:
		cfg.NUMANode = numaAuto
		numa = numaSetting{auto: true, node: -1}
	case numaNone:
		numa = numaSetting{node: -1}
	default:
		n, err := strconv.Atoi(cfg.NUMANode)
		if err != nil || n < 0 {
			return bad("NUMANode %q: must be %q, %q or a node number ≥ 0", cfg.NUMANode, numaAuto, numaNone)
		}
		numa = numaSetting{node: n}
	}
	if cfg.PrefaultThreads < 0 {
		return bad("PrefaultThreads = %d: must not be negative", cfg.PrefaultThreads)
	}
	if cfg.PrefaultThreads == 0 {
		cfg.PrefaultThreads = min(runtime.NumCPU(), defaultMaxPrefaultThreads)
	}
	if cfg.MaxInFlightBytes < 0 || cfg.MaxQueuedBytes < 0 || cfg.MaxCachedBytes < 0 {
		return bad("MaxInFlightBytes = %d, MaxQueuedBytes = %d, MaxCachedBytes = %d: must not be negative", cfg.MaxInFlightBytes, cfg.MaxQueuedBytes, cfg.MaxCachedBytes)
	}
	if cfg.MaxInFlightBytes == 0 {
		cfg.MaxInFlightBytes = defaultMaxInFlightBytes
	}
	if cfg.MaxQueuedBytes == 0 {
		cfg.MaxQueuedBytes = defaultMaxQueuedBytes
	}
	spec, err := kvLayoutSpec(cfg.Layout)
	if err != nil {
		return Config{}, numaSetting{}, 0, err
	}
	if layoutEmpty(cfg.Layout) {
		if cfg.Backend == BackendCUDA {
			return bad("Layout: the CUDA backend needs the device tensors' addresses (LayerTensors, or Base and Stride)")
		}
		spec = kvcache.DenseRankSpec(spec.Kind, spec.Geometry, spec.Order, spec.Heads, spec.NumBlocks, denseProbeBase)
	}
	layout, err := kvcache.NewLayout(spec)
	if err != nil {
		return bad("Layout: %w", err)
	}
	if layout.SlotSize() > math.MaxInt64 {
		return bad("Layout: slot size %d bytes exceeds %d", layout.SlotSize(), int64(math.MaxInt64))
	}
	slot := int64(layout.SlotSize())
	if cfg.PartialTimeout < 0 {
		return bad("PartialTimeout = %v: must not be negative (0: kvcache.DefaultPartialTimeout, %v)", cfg.PartialTimeout, kvcache.DefaultPartialTimeout)
	}
	if cfg.PartialTimeout == 0 {
		cfg.PartialTimeout = kvcache.DefaultPartialTimeout
	}
	if layoutEmpty(cfg.Layout) {
		// The host backend allocates the tensors: NumBlocks slots of
		// device memory, placed from denseProbeBase.
		if n, ok := mulSizes(slot, int64(cfg.Layout.NumBlocks)); !ok || n > math.MaxInt64-denseProbeBase {
			return bad("Layout: NumBlocks = %d × slot size %d bytes overflows the device address space", cfg.Layout.NumBlocks, slot)
		}
	}
	if cfg.PoolBytes < slot {
		return Config{}, numaSetting{}, 0, fmt.Errorf("%w: PoolBytes = %d cannot hold one block of %d bytes", ErrPoolTooSmall, cfg.PoolBytes, slot)
	}
	if cfg.FirstRegionBytes < slot || cfg.RegionBytes < slot {
		return bad("FirstRegionBytes = %d, RegionBytes = %d: each must hold at least one block of %d bytes", cfg.FirstRegionBytes, cfg.RegionBytes, slot)
	}
	if cfg.MaxInFlightBytes < slot {
		return bad("MaxInFlightBytes = %d: must hold at least one block of %d bytes", cfg.MaxInFlightBytes, slot)
	}
	if blocks := cfg.PoolBytes / slotStride(slot); blocks > kvcache.MaxSlots {
		return bad("PoolBytes = %d holds %d blocks of %d bytes (%d with alignment), at most %d (kvcache.MaxSlots)", cfg.PoolBytes, blocks, slot, slotStride(slot), kvcache.MaxSlots)
	}
	if n := regionCount(planTarget(cfg), min(cfg.FirstRegionBytes, planTarget(cfg)), cfg.RegionBytes, slot); n > maxRegions {
		return bad("PoolBytes = %d in regions of RegionBytes = %d (first FirstRegionBytes = %d) makes %d regions, at most %d (maxRegions)",
			planTarget(cfg), cfg.RegionBytes, cfg.FirstRegionBytes, n, maxRegions)
	}
	if err := diskDefaults(&cfg, slot); err != nil {
		return Config{}, numaSetting{}, 0, err
	}
	if err := clusterDefaults(&cfg); err != nil {
		return Config{}, numaSetting{}, 0, err
	}
	return cfg, numa, slot, nil
}

// maxRegions bounds the regions a pool is planned in: PoolBytes (or
// MaxCachedBytes when smaller) over RegionBytes, plus the first region.
// New refuses a plan of more, before building it: the plan has one entry
// per region.
const maxRegions = 1 << 16

// planTarget is the pool bytes the region plan covers: PoolBytes, or
// MaxCachedBytes when positive and smaller.
func planTarget(cfg Config) int64 {
	if cfg.MaxCachedBytes > 0 {
		return min(cfg.PoolBytes, cfg.MaxCachedBytes)
	}
	return cfg.PoolBytes
}

// regionCount is len(regionPlan(pool, first, region, slot)), computed
// without building the plan; region must hold a slot.
func regionCount(pool, first, region, slot int64) int64 {
	first = first / slot * slot
	region = region / slot * slot
	left := pool/slot*slot - min(first, pool/slot*slot)
	n := 1 + left/region
	if left%region != 0 {
		n++
	}
	return n
}

func layoutKind(k LayoutKind) (kvcache.LayoutKind, error) {
	switch k {
	case LayoutLayerSeparate:
		return kvcache.LayerSeparate, nil
	case LayoutCrossLayer:
		return kvcache.CrossLayer, nil
	case LayoutMLA:
		return kvcache.MLA, nil
	}
	return 0, checkEnum("Layout.Kind", k, layoutKinds)
}

// denseProbeBase is a made-up address for checking a layout given without
// tensors.
const denseProbeBase = 1 << 40

// layoutEmpty reports whether l gives no tensor addresses.
func layoutEmpty(l LayoutSpec) bool { return len(l.LayerTensors) == 0 && l.Base == 0 && l.Stride == 0 }

// headOrder converts LayoutSpec.Order to kvcache's.
func headOrder(o HeadOrder) (kvcache.HeadOrder, error) {
	switch o {
	case "":
		return kvcache.OrderUndeclared, nil
	case OrderTokenMajor:
		return kvcache.TokenMajor, nil
	case OrderHeadMajor:
		return kvcache.HeadMajor, nil
	}
	return 0, checkEnum("Layout.Order", o, headOrders)
}

// modelKVHeads is the model's KV heads of l: ModelKVHeads, or KVHeads
// when it is 0.
func modelKVHeads(l LayoutSpec) int {
	if l.ModelKVHeads != 0 {
		return l.ModelKVHeads
	}
	return l.KVHeads
}

// checkHeads checks the head fields of l (ErrInvalidConfig naming the
// value and the limit): the rank's heads [HeadFirst, HeadFirst+KVHeads)
// inside the model's ModelKVHeads, and a declared Order for a rank
// holding fewer heads than the model. The dimensions themselves are
// kvcache's to check.
func checkHeads(l LayoutSpec) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: Layout."+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	if l.ModelKVHeads < 0 {
		return bad("ModelKVHeads = %d: must not be negative (0: KVHeads, every head)", l.ModelKVHeads)
	}
	if l.HeadFirst < 0 {
		return bad("HeadFirst = %d: must not be negative", l.HeadFirst)
	}
	if l.ModelKVHeads == 0 {
		if l.HeadFirst != 0 {
			return bad("HeadFirst = %d without ModelKVHeads: a head range needs the model's KV heads", l.HeadFirst)
		}
		return nil
	}
	if l.KVHeads > l.ModelKVHeads || l.HeadFirst > l.ModelKVHeads-max(l.KVHeads, 0) {
		return bad("heads [%d, %d) (HeadFirst %d, KVHeads %d) outside the model's ModelKVHeads = %d heads [0, %d)",
			l.HeadFirst, l.HeadFirst+l.KVHeads, l.HeadFirst, l.KVHeads, l.ModelKVHeads, l.ModelKVHeads)
	}
	if l.KVHeads < l.ModelKVHeads && l.Order == "" {
		return bad("KVHeads = %d of ModelKVHeads = %d: a rank holding part of the model's heads needs Order (%q or %q)",
			l.KVHeads, l.ModelKVHeads, OrderTokenMajor, OrderHeadMajor)
	}
	return nil
}

// kvLayoutSpec converts the plain-data layout to kvcache's: the geometry
// is the model's (KVHeads = ModelKVHeads), the rank's heads its Heads.
func kvLayoutSpec(l LayoutSpec) (kvcache.LayoutSpec, error) {
	kind, err := layoutKind(l.Kind)
	if err != nil {
		return kvcache.LayoutSpec{}, err
	}
	order, err := headOrder(l.Order)
	if err != nil {
		return kvcache.LayoutSpec{}, err
	}
	if err := checkHeads(l); err != nil {
		return kvcache.LayoutSpec{}, err
	}
	spec := kvcache.LayoutSpec{
		Kind: kind,
		Geometry: kvcache.Geometry{Layers: l.Layers, KVHeads: modelKVHeads(l), HeadDim: l.HeadDim,
			DTypeBytes: l.DTypeBytes, TokensPerBlock: l.TokensPerBlock},
		NumBlocks: l.NumBlocks,
		Base:      l.Base,
		Stride:    l.Stride,
		Order:     order,
	}
	if l.ModelKVHeads != 0 {
		spec.Heads = kvcache.HeadRange{First: l.HeadFirst, Count: l.KVHeads}
	}
	for _, t := range l.LayerTensors {
		spec.Layers = append(spec.Layers, kvcache.LayerTensors{K: t.K, V: t.V, Stride: t.Stride})
	}
	return spec, nil
}

// fromKVLayoutSpec converts kvcache's layout spec back to plain data.
func fromKVLayoutSpec(s kvcache.LayoutSpec) LayoutSpec {
	l := LayoutSpec{Kind: LayoutKind(s.Kind.String()), Layers: s.Geometry.Layers, KVHeads: s.Geometry.KVHeads,
		HeadDim: s.Geometry.HeadDim, DTypeBytes: s.Geometry.DTypeBytes, TokensPerBlock: s.Geometry.TokensPerBlock,
		NumBlocks: s.NumBlocks, Base: s.Base, Stride: s.Stride}
	if s.Heads != (kvcache.HeadRange{}) {
		l.KVHeads, l.ModelKVHeads, l.HeadFirst = s.Heads.Count, s.Geometry.KVHeads, s.Heads.First
	}
	switch s.Order {
	case kvcache.TokenMajor:
		l.Order = OrderTokenMajor
	case kvcache.HeadMajor:
		l.Order = OrderHeadMajor
	}
	for _, t := range s.Layers {
		l.LayerTensors = append(l.LayerTensors, LayerTensors{K: t.K, V: t.V, Stride: t.Stride})
	}
	return l
}

// regionPlan splits the pool into region sizes: the first region, then
// RegionBytes regions, the last one holding the remainder. Each region
// holds whole slots (a slot never straddles two regions), so region sizes
// are multiples of the slot size and the pool is PoolBytes rounded down to
// whole slots.
func regionPlan(pool, first, region, slot int64) []int64 {
	first = first / slot * slot
	region = region / slot * slot
	left := pool / slot * slot
	var plan []int64
	n := min(first, left)
	plan = append(plan, n)
	left -= n
	for left > 0 {
		n = min(region, left)
		plan = append(plan, n)
		left -= n
	}
	return plan
}
