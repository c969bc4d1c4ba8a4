package offload

import (
	"context"
	"fmt"
	"sync"

	"github.com/kvoffload/kvoffload/internal/tier/record"
	"github.com/kvoffload/kvoffload/kvcache"
)

// RankView is another tensor-parallel rank's view of an engine
// (Engine.Rank).
type RankView struct {
	eng    *Engine
	layout *kvcache.Layout
	spec   LayoutSpec
}

// rankViews are the device allocations Rank made on the host backend for
// layouts given without tensors, freed by Close.
type rankViews struct {
	mu    sync.Mutex
	dense []uint64
}

// Rank returns the view of another rank's layout (its addresses and heads).
func (e *Engine) Rank(layout LayoutSpec) (*RankView, error) {
	if !e.enter() {
		return nil, fmt.Errorf("%w: Rank after Close", ErrClosed)
	}
	defer e.leave()
	bad := func(format string, args ...any) (*RankView, error) {
		return nil, fmt.Errorf("%w: Rank: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	mine := e.cfg.Layout
	switch {
	case layout.Kind != mine.Kind:
		return bad("Kind %q, the engine's is %q", layout.Kind, mine.Kind)
	case layout.Layers != mine.Layers:
		return bad("Layers = %d, the engine's is %d", layout.Layers, mine.Layers)
	case modelKVHeads(layout) != modelKVHeads(mine):
		return bad("the model's KV heads (ModelKVHeads, or KVHeads) = %d, the engine's is %d", modelKVHeads(layout), modelKVHeads(mine))
	case layout.HeadDim != mine.HeadDim:
		return bad("HeadDim = %d, the engine's is %d", layout.HeadDim, mine.HeadDim)
	case layout.DTypeBytes != mine.DTypeBytes:
		return bad("DTypeBytes = %d, the engine's is %d", layout.DTypeBytes, mine.DTypeBytes)
	case layout.TokensPerBlock != mine.TokensPerBlock:
		return bad("TokensPerBlock = %d, the engine's is %d", layout.TokensPerBlock, mine.TokensPerBlock)
	case layout.NumBlocks != mine.NumBlocks:
		return bad("NumBlocks = %d, the engine's is %d", layout.NumBlocks, mine.NumBlocks)
	case mine.Order == "" || layout.Order == "":
		return bad("Order %q, the engine's %q: ranks share slots only in a declared order (%q or %q) on both", layout.Order, mine.Order, OrderTokenMajor, OrderHeadMajor)
	}
	spec, err := kvLayoutSpec(layout)
	if err != nil {
		return nil, fmt.Errorf("Rank: %w", err)
	}
	var dense uint64
	if layoutEmpty(layout) {
		if e.sim == nil {
			return bad("the CUDA backend needs the rank's device tensors' addresses (LayerTensors, or Base and Stride)")
		}
		if dense, err = e.allocDense(&spec); err != nil {
			return nil, fmt.Errorf("Rank: %w", err)
		}
		layout = fromKVLayoutSpec(spec)
	}
	fail := func(err error) (*RankView, error) {
		if dense != 0 {
			_ = e.sim.MemFree(dense)
		}
		return nil, err
	}
	l, err := kvcache.NewLayout(spec)
	if err != nil {
		return fail(fmt.Errorf("%w: Rank: Layout: %w", ErrInvalidConfig, err))
	}
	if l.SlotSize() != e.layout.SlotSize() || hostFormat(l) != hostFormat(e.layout) {
		return fail(fmt.Errorf("%w: Rank: slot of %d bytes (%v), the engine's is %d (%v)", ErrInvalidConfig,
			l.SlotSize(), hostFormat(l), e.layout.SlotSize(), hostFormat(e.layout)))
	}
	ts := deviceTensorsOf(layout)
	if e.gpu != nil {
		if err := e.gpu.Do(func() error { return e.checkTensorsOf(ts) }); err != nil {
			return fail(fmt.Errorf("Rank: %w", err))
		}
	}
	if err := e.addRangesOf(ts); err != nil {
		return fail(fmt.Errorf("%w: Rank: %w", ErrInvalidConfig, err))
	}
	if dense != 0 {
		e.views.mu.Lock()
		e.views.dense = append(e.views.dense, dense)
		e.views.mu.Unlock()
	}
	return &RankView{eng: e, layout: l, spec: layout}, nil
}

// layoutSpec returns the view's layout (with the tensors Rank allocated, on
// the host backend, for a layout given without them).
func (v *RankView) layoutSpec() LayoutSpec { return v.spec }

// Store is Engine.Store of the rank's heads; visible once every head is.
func (v *RankView) Store(ctx context.Context, keys []Key, blockIDs []int, opts StoreOptions) (*Op, error) {
	e := v.eng
	if err := e.checkOpen("Store"); err != nil {
		return nil, err
	}
	if err := e.checkBlocks("Store", keys, blockIDs); err != nil {
		return nil, err
	}
	return e.store(ctx, v.layout, keys, blockIDs, opts)
}

// Load is Engine.Load of the rank's heads.
func (v *RankView) Load(ctx context.Context, keys []Key, blockIDs []int, opts LoadOptions) (*Op, error) {
	e := v.eng
	if err := e.checkOpen("Load"); err != nil {
		return nil, err
	}
	if err := e.checkBlocks("Load", keys, blockIDs); err != nil {
		return nil, err
	}
	return e.load(ctx, v.layout, keys, blockIDs, opts)
}

// Lookup is Engine.Lookup.
func (v *RankView) Lookup(keys []Key, opts LookupOptions) (LookupResult, error) {
	return v.eng.Lookup(keys, opts)
}

// hostFormat is the format of layout l's slots: head-major for a layout
// of declared order, a byte copy of the device's segments otherwise.
func hostFormat(l *kvcache.Layout) record.HostFormat {
	if l.Order() == kvcache.OrderUndeclared {
		return record.HostDeviceOrder
	}
	return record.HostHeadMajor
}

// rankBytes is what one block's copy moves for layout l: the rank's heads
// for a layout of declared order, the slot for one of undeclared order
// (as before head ranges existed).
func (e *Engine) rankBytes(l *kvcache.Layout) int64 {
	if l.Order() == kvcache.OrderUndeclared {
		return e.slot
	}
	return int64(l.RankBytes())
}

// endedStores returns the slots of a Store's completion whose store ended
// (its pending KV-event details can go): every slot on failure; on success
// all but the head-range writes that left their block partial, whose
// details the last rank's completion announces.
func endedStores(slots, ready []kvcache.Slot, cerr error) []kvcache.Slot {
	if cerr != nil {
		return slots
	}
	out := make([]kvcache.Slot, 0, len(slots))
	j := 0
	for _, s := range slots {
		isReady := j < len(ready) && ready[j].ID == s.ID && ready[j].Gen == s.Gen
		if isReady {
			j++
		}
		if isReady || s.Heads == (kvcache.HeadRange{}) {
			out = append(out, s)
		}
	}
	return out
}

// readyKeys returns the keys of wt (one per slot of slots) whose slots are
// in ready (a subsequence of slots, CompleteStoreReady's answer), or nil
// when wt is nil (no write-through).
func readyKeys(wt []Key, slots, ready []kvcache.Slot) []Key {
	if wt == nil {
		return nil
	}
	out := make([]Key, 0, len(ready))
	j := 0
	for i, s := range slots {
		if j < len(ready) && ready[j].ID == s.ID && ready[j].Gen == s.Gen {
			out = append(out, wt[i])
			j++
		}
	}
	return out
}
