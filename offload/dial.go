package offload

import (
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/kvoffload/kvoffload/internal/nodepool"
	"github.com/kvoffload/kvoffload/internal/nodepool/wire"
	"github.com/kvoffload/kvoffload/kvcache"
)

// nominalDialPool is the PoolBytes an engine of Dial is validated with
// when its Config gives none: the pool is the node's, Config.PoolBytes is
// not used.
const nominalDialPool = 1 << 40

// Dial returns an engine sharing the pool of the node at socket (`kvoffload
// serve`); without tensors and the host backend it only looks up.
func Dial(socket string, cfg Config) (*Engine, error) {
	return dialEngine(socket, cfg, engineHooks{})
}

// dialState is the node connection of an engine of Dial.
type dialState struct {
	socket string
	noGPU  bool
	// client is set once Dial returned (the hooks run before, and on the
	// client's goroutines meanwhile).
	client atomic.Pointer[nodepool.Client]
	ns     kvcache.Namespace // the engine's id of Config.Namespace
	nsID   atomic.Uint32     // the node's id of Config.Namespace (event filter), 0: unknown
	// live are the node's regions pinned here and known to the scheduler,
	// by nodeRegion id; guarded by the engine's memory.mu. gate admits
	// copies only on these.
	live map[kvcache.RegionID]*poolRegion
}

func dialEngine(socket string, cfg Config, h engineHooks) (*Engine, error) {
	switch {
	case cfg.Disk != nil:
		return nil, fmt.Errorf("%w: Dial: the disk tier is not available through a node", ErrInvalidConfig)
	case cfg.Cluster != nil:
		return nil, fmt.Errorf("%w: Dial: the cluster tier is not available through a node", ErrInvalidConfig)
	case cfg.ZeroOnRelease:
		return nil, fmt.Errorf("%w: Dial: ZeroOnRelease is not available through a node", ErrInvalidConfig)
	}
	d := &dialState{socket: socket, live: map[kvcache.RegionID]*poolRegion{}}
	if layoutEmpty(cfg.Layout) && cfg.Backend != BackendHost {
		d.noGPU = true
		cfg.Backend = BackendHost // a simulation nothing copies with
		cfg.StagingBytes = -1
	}
	if cfg.PoolBytes <= 0 {
		cfg.PoolBytes = nominalDialPool
	}
	cfg.SkipMemoryCheck = true // nothing of the pool is this process's to check
	h.dial = d
	return newEngine(cfg, h)
}

// openDial is newEngine's end for an engine of Dial, once the device, the
// layout and the scheduler are up: connect, and map the staging region.
func (e *Engine) openDial(d *dialState) error {
	e.dial = d
	d.ns = e.namespace(e.cfg.Namespace)
	e.growth.plan, e.growth.target, e.growth.done = nil, 0, true
	spec, err := kvLayoutSpec(e.cfg.Layout)
	if err != nil {
		return err
	}
	ccfg := nodepool.ClientConfig{Namespace: e.cfg.Namespace, Layout: nodepool.LayoutOf(spec.Kind, spec.Geometry), NoMap: d.noGPU,
		PrefaultThreads: e.cfg.PrefaultThreads, OnEvents: e.onNodeEvents,
		Hooks: nodepool.Hooks{RegionAdded: e.regionAdded, RegionRetiring: e.regionRetiring}}
	c, err := nodepool.Dial(d.socket, ccfg)
	if err != nil {
		if errors.Is(err, nodepool.ErrLayout) {
			return fmt.Errorf("%w: Dial: %w", ErrInvalidConfig, err)
		}
		return nodeErr(err)
	}
	d.client.Store(c)
	d.nsID.Store(c.Info().NamespaceID)
	e.cache = &nodeIndex{c: c, ns: d.ns, kvHeads: spec.Geometry.KVHeads}
	if e.cfg.StagingBytes > 0 {
		if e.stage.region, err = e.mapRegion(e.cfg.StagingBytes, false); err != nil {
			return fmt.Errorf("offload: staging region: %w", err)
		}
		if e.stage.dev, err = e.stagingDevicePtr(e.stage.region); err != nil {
			return err
		}
	}
	e.stats.firstSlot.Store(int64(time.Since(e.start)))
	e.stats.fullPool.Store(int64(time.Since(e.start)))
	return nil
}

// closeDial says goodbye to the node (every op has ended: Close waited for
// them) and retires the regions (regionRetiring). Before the scheduler
// closes.
func (e *Engine) closeDial() error {
	if e.dial == nil || e.dial.client.Load() == nil {
		return nil
	}
	if err := e.dial.client.Load().Close(); err != nil && !errors.Is(err, nodepool.ErrClientClosed) {
		return err
	}
	return nil
}

// regionAdded is nodepool's Hooks.RegionAdded: pin the node's region here
// and tell the scheduler its host ranges, as growth does for a region of
// its own.
func (e *Engine) regionAdded(r *nodepool.Region) error {
	d := e.dial
	pr := &poolRegion{id: nodeRegion(r.ID, r.Epoch()), r: r.Mapping(), borrowed: true}
	if err := e.pinMapped(pr, true); err != nil {
		return err
	}
	if len(pr.rangeStarts) > 0 {
		e.unmapRegion(pr)
		return fmt.Errorf("offload: the node's region %d of %d bytes needs %d registrations here: at most 64 GiB per region", r.ID, r.Size, len(pr.rangeStarts)+1)
	}
	e.memory.mu.Lock()
	d.live[pr.id] = pr
	e.memory.regions = append(e.memory.regions, pr)
	e.memory.owned += pr.r.Len()
	e.memory.mu.Unlock()
	if c := d.client.Load(); c != nil {
		d.nsID.Store(c.Info().NamespaceID) // a new connection's (reconnected)
	}
	return nil
}

// regionRetiring is nodepool's Hooks.RegionRetiring: no new copy on the
// region (gate), wait for this engine's copies on it, then unpin it and
// forget its host ranges. The client unmaps it after.
func (e *Engine) regionRetiring(r *nodepool.Region) {
	d := e.dial
	id := nodeRegion(r.ID, r.Epoch())
	e.memory.mu.Lock()
	pr := d.live[id]
	if pr == nil {
		e.memory.mu.Unlock()
		return
	}
	delete(d.live, id)
	e.memory.regions = slices.DeleteFunc(e.memory.regions, func(x *poolRegion) bool { return x == pr })
	e.memory.owned -= pr.r.Len()
	if e.memory.draining == nil {
		e.memory.draining = map[kvcache.RegionID]*poolRegion{}
	}
	e.memory.draining[id] = pr // unhold wakes us once its last copy ends
	for e.memory.inflight[id] > 0 {
		ch := e.memory.changed
		e.memory.mu.Unlock()
		<-ch
		e.memory.mu.Lock()
	}
	delete(e.memory.draining, id)
	e.memory.mu.Unlock()
	e.unmapRegion(pr)
}

// gate admits the copies of an engine of Dial: every slot's region must
// be pinned here (not retiring); it counts them in flight at once
// (memory.inflight, which regionRetiring waits on), in place of hold.
// copyPlan calls it last, so that a plan that fails holds nothing; the
// op's unhold ends the count.
func (e *Engine) gate(slots []kvcache.Slot) error {
	d := e.dial
	if d == nil {
		return nil
	}
	e.memory.mu.Lock()
	defer e.memory.mu.Unlock()
	for _, s := range slots {
		if d.live[s.Region] == nil {
			return fmt.Errorf("%w: the node's region %d (connection %d) is gone from this process", ErrUnavailable, uint32(s.Region), s.Region>>32)
		}
	}
	for _, s := range slots {
		e.memory.inflight[s.Region]++
	}
	return nil
}

// commitFailed is what the store completion reports of its CompleteStore
// error: an engine of Dial whose commit the node did not take has not
// stored the blocks (OutcomeFailed); the embedded index never fails a
// commit of slots it handed out.
func (e *Engine) commitFailed(err error) error {
	if e.dial == nil || err == nil {
		return nil
	}
	return fmt.Errorf("offload: the node did not commit the store: %w", err)
}

// onNodeEvents is the client's OnEvents: the node's KV events of this
// engine's namespace, to Events' streams.
func (e *Engine) onNodeEvents(evs []wire.Event) {
	d := e.dial
	ns := d.nsID.Load()
	for _, ev := range evs {
		if ns != 0 && ev.NS != ns {
			continue
		}
		e.hub.onIndex(kvcache.IndexEvent{Ready: ev.Kind == wire.EventStored, Evicted: ev.Kind == wire.EventRemoved, Key: ev.Key, Namespace: d.ns})
	}
}

// trimNode is Trim for an engine of Dial: the node trims its pool for
// every client.
func (e *Engine) trimNode(bytes int64) (TrimResult, error) {
	res := TrimResult{RequestedBytes: bytes}
	if bytes <= 0 {
		return res, nil
	}
	e.stats.trims.Add(1)
	r, err := e.dial.client.Load().Trim(bytes)
	if err != nil {
		return res, nodeErr(err)
	}
	res.FreedBytes, res.PendingBytes, res.Regions = r.FreedBytes, r.PendingBytes, r.Regions
	return res, nil
}

// checkDialed refuses what an engine of Dial cannot do (call names it).
func (e *Engine) checkDialed(call string) error {
	if e.dial != nil && e.dial.noGPU && (call == "Store" || call == "Load") {
		return fmt.Errorf("%w: %s: an engine of Dial without layout tensors has no GPU (Lookup, Delete, Clear, Stats, Events only)", ErrInvalidArgument, call)
	}
	return nil
}
