package nodepool

// The index: newCache, which creates the kvcache.Cache (and opens the
// disk tier) with the first client's layout, and the index's events:
// onIndex queues them, fanOutEvents pushes them in batches to the
// subscribed clients.
//
// Locks: newCache runs with s.mu held (from hello). onIndex runs under
// the cache's lock and takes no Server lock (the disk tier's Ready
// takes its own mu, read, under it: internal/tiered); fanOutEvents takes s.mu to
// walk s.peers.

import (
	"fmt"

	"github.com/kvoffload/kvoffload/internal/nodepool/wire"
	"github.com/kvoffload/kvoffload/internal/tiered"
	"github.com/kvoffload/kvoffload/kvcache"
)

// newCache creates the index with the first client's layout and hands it
// every region. s.mu held.
func (s *Server) newCache(layout *kvcache.Layout) error {
	var pol kvcache.Policy
	slots := 0
	for _, rr := range s.regions {
		slots += int(uint64(rr.r.Len()) / layout.SlotSize())
	}
	if s.cfg.Policy == "tinylfu" {
		t, err := kvcache.NewTinyLFU(kvcache.TinyLFUConfig{MaxBlocks: max(slots, 1)})
		if err != nil {
			return err
		}
		pol = t
	}
	// The disk tier opens first: its Demote and OnDemote are the cache's.
	var d *tiered.Tier
	if s.cfg.Disk != nil {
		var err error
		if d, err = s.openDisk(layout, layout.Kind()); err != nil {
			s.diskErr = err.Error()
			s.cfg.Logf("%v: serving without the disk tier", err)
		}
	}
	kcfg := kvcache.Config{Layout: layout, Policy: pol, LowWatermark: s.cfg.LowWatermark,
		OnIndex: s.onIndex, MaxSlots: min(slots, kvcache.MaxSlots)}
	switch {
	case kcfg.LowWatermark < 0:
		kcfg.LowWatermark = 0
	case kcfg.LowWatermark == 0 && s.cfg.Disk != nil:
		// The embedded engine's: evictions run ahead of stores.
		kcfg.LowWatermark = tiered.LowWatermark(slots)
	}
	if d != nil {
		kcfg.Demote, kcfg.OnDemote = d.Demote, d.OnDemote
	}
	c, err := kvcache.New(kcfg)
	if err != nil {
		if d != nil {
			_ = d.Store.Close()
		}
		return err
	}
	ids := make([]*regionRec, 0, len(s.regions))
	for _, rr := range s.regions {
		ids = append(ids, rr)
	}
	sortRegions(ids)
	// Highest id first: the free list hands out the slots of the region
	// added last first, and clients map regions in id order, so the
	// first region (mapped inside Dial) serves the first stores.
	for i := len(ids) - 1; i >= 0; i-- {
		rr := ids[i]
		if _, err := c.AddRegion(kvcache.Region{ID: kvcache.RegionID(rr.id), Base: rr.r.Addr(), Size: uint64(rr.r.Len())}); err != nil {
			c.Close()
			if d != nil {
				_ = d.Store.Close()
			}
			return fmt.Errorf("nodepool: region %d: %w", rr.id, err)
		}
	}
	s.cache, s.slotSize = c, layout.SlotSize()
	s.accts.setShare(min(slots, kvcache.MaxSlots), s.lim.share)
	if d != nil {
		d.Start(c)
		s.disk = d
	}
	return nil
}

// onIndex runs under the cache's lock: it only copies the event out, and
// drops it (counted) when the fan-out is behind.
func (s *Server) onIndex(e kvcache.IndexEvent) {
	if e.Ready && s.disk != nil {
		s.disk.Ready(e.Key)
	}
	if s.subscribers.Load() == 0 {
		return
	}
	k := wire.EventRemoved
	if e.Ready {
		k = wire.EventStored
	}
	select {
	case s.events <- wire.Event{Kind: k, NS: uint32(e.Namespace), Key: e.Key}:
	default:
		s.counter.eventsDropped.Add(1)
	}
}

func (s *Server) fanOutEvents() {
	batch := make([]wire.Event, 0, wire.MaxKeys)
	for {
		select {
		case <-s.stop:
			return
		case e := <-s.events:
			batch = append(batch[:0], e)
		more:
			for len(batch) < wire.MaxKeys {
				select {
				case e := <-s.events:
					batch = append(batch, e)
				default:
					break more
				}
			}
			if f := s.cfg.OnEvents; f != nil {
				f(batch)
			}
			s.mu.Lock()
			for _, p := range s.peers {
				if p.subscribed {
					p.push(&wire.Msg{Type: wire.TEvents, Events: append([]wire.Event(nil), batch...)}, -1)
				}
			}
			s.mu.Unlock()
		}
	}
}
