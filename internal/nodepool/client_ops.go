package nodepool

// The ops: Lookup and LookupTiers, BeginStore, BeginLoad,
// BeginLoadTiers and Promote, the give-backs (Unlease, CommitStore,
// AbortStore, EndLoad), Delete, Clear, Stats and Trim. Each is one round
// trip through callEpoch, or more for more than wire.MaxKeys keys.
//
// Locks: none of their own; curEpoch and the resolver take c.mu briefly.

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"

	"github.com/kvoffload/kvoffload/internal/nodepool/wire"
)

// Lookup returns how many leading keys are ready in the pool; with lease,
// it leases them (give them back with Unlease) and appends their slots to
// dst. A leased block whose region is not usable here ends the hits (and
// is unleased).
func (c *Client) Lookup(keys []Key, lease bool, dst []Slot) (hits int, leased []Slot, err error) {
	hits, _, leased, err = c.LookupTiers(keys, lease, dst)
	return hits, leased, err
}

// LookupTiers is Lookup that also returns lower: how many keys after the
// hits the node's disk tier holds (ServerConfig.Disk; 0 without one),
// which a BeginLoad of them promotes into the pool first.
func (c *Client) LookupTiers(keys []Key, lease bool, dst []Slot) (hits, lower int, leased []Slot, err error) {
	leased = dst
	start := len(dst)
	for len(keys) > 0 {
		n := min(len(keys), wire.MaxKeys)
		m := c.msgs.Get().(*wire.Msg)
		m.Reset()
		m.Type, m.Keys = wire.TLookup, append(m.Keys, keys[:n]...)
		if lease {
			m.Flags = wire.FlagLease
		}
		epoch := c.curEpoch()
		r, err := c.callEpoch(m, wire.TLookupOK, epoch)
		c.msgs.Put(m)
		if err != nil {
			_ = c.Unlease(leased[start:])
			return 0, 0, leased[:start], err
		}
		h := int(r.N)
		replied, low := h, int(r.Lower) // r goes back to the pool below
		var drop []Slot
		rv := c.resolverAt(epoch)
		leased = slices.Grow(leased, len(r.Slots))
		for i := range r.Slots {
			k := len(leased)
			leased = leased[:k+1]
			if !rv.put(&leased[k], &r.Slots[i]) || h < i {
				h = min(h, i)
				drop = append(drop, leased[k])
				leased = leased[:k]
			}
		}
		c.done(r)
		if len(drop) > 0 {
			_ = c.Unlease(drop)
		}
		hits += h
		if h < n {
			if h == replied {
				lower = low // not when a leased block ended the hits early
			}
			break
		}
		keys = keys[n:]
	}
	return hits, lower, leased, nil
}

// handles sends slots back in requests of type t, split by epoch and by
// wire.MaxKeys. Slots of an earlier connection are already released (the
// node that held them is gone): only stale is returned for them, nil when
// stale is nil.
func (c *Client) handles(t wire.Type, slots []Slot, stale error) error {
	epoch := c.curEpoch()
	var first error
	m := c.msgs.Get().(*wire.Msg)
	defer c.msgs.Put(m)
	for len(slots) > 0 {
		m.Reset()
		m.Type = t
		i := 0
		for ; i < len(slots) && len(m.Handles) < wire.MaxKeys; i++ {
			if slots[i].Epoch != epoch {
				if first == nil {
					first = stale
				}
				continue
			}
			m.Handles = append(m.Handles, wire.Handle{ID: slots[i].ID, Gen: slots[i].Gen})
		}
		slots = slots[i:]
		if len(m.Handles) == 0 {
			continue
		}
		r, err := c.callEpoch(m, wire.TOK, epoch)
		if err != nil {
			if errors.Is(err, ErrUnavailable) {
				err = stale
			}
			if first == nil {
				first = err
			}
			continue
		}
		c.done(r)
	}
	return first
}

// Unlease gives back leases of Lookup. Leases of a node that went away
// are gone with it (nil).
func (c *Client) Unlease(slots []Slot) error { return c.handles(wire.TUnlease, slots, nil) }

// CommitStore makes the blocks of slots (reserved by BeginStore) ready.
// Call it only once every copy into them has retired. If the node went
// away since BeginStore, nothing was stored: ErrUnavailable.
func (c *Client) CommitStore(slots []Slot) error {
	return c.handles(wire.TCommitStore, slots, ErrUnavailable)
}

// AbortStore gives back reservations whose copies failed (or were never
// made): the blocks never become ready. Call it once no copy into them is
// in flight.
func (c *Client) AbortStore(slots []Slot) error { return c.handles(wire.TAbortStore, slots, nil) }

// EndLoad ends loads of BeginLoad once their copies retired.
func (c *Client) EndLoad(slots []Slot) error { return c.handles(wire.TEndLoad, slots, nil) }

// BeginStore reserves a slot for each key to store, appending one result
// per key to dst.
func (c *Client) BeginStore(req StoreRequest, dst []StoreResult) ([]StoreResult, error) {
	if c.cfg.NoMap {
		return dst, fmt.Errorf("%w: a client without mappings (NoMap) cannot store", ErrInvalid)
	}
	if req.Parents != nil && len(req.Parents) != len(req.Keys) {
		return dst, fmt.Errorf("%w: %d parents for %d keys", ErrInvalid, len(req.Parents), len(req.Keys))
	}
	if req.HeadLo < 0 || req.HeadHi < req.HeadLo || req.HeadHi > 1<<16-1 {
		return dst, fmt.Errorf("%w: head range [%d, %d)", ErrInvalid, req.HeadLo, req.HeadHi)
	}
	start := len(dst)
	parent := req.Parent
	keys := req.Keys
	m := c.msgs.Get().(*wire.Msg)
	defer c.msgs.Put(m)
	for off := 0; off < len(keys); {
		n := min(len(keys)-off, wire.MaxKeys)
		m.Reset()
		m.Type, m.HeadLo, m.HeadHi = wire.TBeginStore, uint16(req.HeadLo), uint16(req.HeadHi)
		m.Keys = append(m.Keys, keys[off:off+n]...)
		if req.Parents != nil {
			m.Parents = append(m.Parents, req.Parents[off:off+n]...)
		} else {
			m.Flags, m.Parent = wire.FlagChain, parent
		}
		epoch := c.curEpoch()
		r, err := c.callEpoch(m, wire.TBeginStoreOK, epoch)
		if err != nil {
			c.abortResults(dst[start:])
			return dst[:start], err
		}
		if len(r.Outcomes) != n {
			// Results would land on the wrong keys: give back what the
			// reply reserved, and what earlier replies did.
			dst = c.storeResults(dst, r, epoch)
			c.abortResults(dst[start:])
			return dst[:start], fmt.Errorf("%w: the node answered %d outcomes to BeginStore of %d keys", ErrInvalid, len(r.Outcomes), n)
		}
		dst = c.storeResults(dst, r, epoch)
		off += n
		parent = keys[off-1]
	}
	return dst, nil
}

// storeResults appends a BeginStore reply's results to dst (aborting the
// reservations of regions not usable here) and gives r back.
func (c *Client) storeResults(dst []StoreResult, r *wire.Msg, epoch uint32) []StoreResult {
	var unusable []Slot
	si := 0
	rv := c.resolverAt(epoch)
	dst = slices.Grow(dst, len(r.Outcomes))
	for _, o := range r.Outcomes {
		dst = append(dst, StoreResult{Outcome: StoreOutcome(o)})
		if o == wire.OutcomeWrite {
			res := &dst[len(dst)-1]
			if !rv.put(&res.Slot, &r.Slots[si]) {
				res.Outcome = StoreUnusable
				unusable = append(unusable, res.Slot)
			}
			si++
		}
	}
	c.done(r)
	if len(unusable) > 0 {
		_ = c.AbortStore(unusable)
	}
	return dst
}

func (c *Client) abortResults(rs []StoreResult) {
	var slots []Slot
	for _, r := range rs {
		if r.Outcome == StoreWrite {
			slots = append(slots, r.Slot)
		}
	}
	_ = c.AbortStore(slots)
}

// BeginLoad leases each key's ready block and counts a copy on it,
// appending one result per key to dst. A found block whose region is not
// usable here is reported missing (and its load ended). With a disk tier
// on the node, the keys the pool lacks and the disk holds are promoted
// first, all of them before the node answers.
func (c *Client) BeginLoad(keys []Key, dst []LoadResult) ([]LoadResult, error) {
	return c.beginLoad(wire.TBeginLoad, 0, keys, nil, dst)
}

// BeginLoadTiers is BeginLoad without the promotion: a key the pool lacks
// and the node's disk tier holds is reported OnDisk (not Found), for
// Promote to bring in, in chunks of the caller's choosing; the node reads
// nothing for it. The same round trip as BeginLoad's.
func (c *Client) BeginLoadTiers(keys []Key, dst []LoadResult) ([]LoadResult, error) {
	return c.beginLoad(wire.TBeginLoad, wire.FlagDiskLater, keys, nil, dst)
}

// Promote promotes keys from the node's disk tier into its pool (the
// records read into slots reserved as a store of this client's namespace
// would, key i's parent parents[i]; a record that fails a check stays
// missing) and then begins their load, as BeginLoad: one result per key
// appended to dst, Found (a load to end with EndLoad) or not. A key
// already in the pool is found without a read. The node serves a
// client's Promotes in order, in the background: its other calls are
// answered meanwhile, and a Promote sent before the last one's reply has
// its reads started as soon as the last one's end. Up to four Promotes
// wait on the node; past them the node reads the client's next requests
// only as its promoter takes one (bounded memory for the keys waiting).
func (c *Client) Promote(keys, parents []Key, dst []LoadResult) ([]LoadResult, error) {
	if len(parents) != len(keys) {
		return dst, fmt.Errorf("%w: %d parents for %d keys", ErrInvalid, len(parents), len(keys))
	}
	return c.beginLoad(wire.TPromote, 0, keys, parents, dst)
}

// beginLoad is BeginLoad (t TBeginLoad, flags) or Promote (TPromote, with
// parents).
func (c *Client) beginLoad(t wire.Type, flags uint8, keys, parents []Key, dst []LoadResult) ([]LoadResult, error) {
	if c.cfg.NoMap {
		return dst, fmt.Errorf("%w: a client without mappings (NoMap) cannot load", ErrInvalid)
	}
	start := len(dst)
	m := c.msgs.Get().(*wire.Msg)
	defer c.msgs.Put(m)
	for off := 0; off < len(keys); {
		n := min(len(keys)-off, wire.MaxKeys)
		m.Reset()
		m.Type, m.Flags = t, flags
		m.Keys = append(m.Keys, keys[off:off+n]...)
		if parents != nil {
			m.Parents = append(m.Parents, parents[off:off+n]...)
		}
		epoch := c.curEpoch()
		r, err := c.callEpoch(m, wire.TBeginLoadOK, epoch)
		if err == nil && len(r.Outcomes) != n {
			// Results would land on the wrong keys: end the loads the
			// reply began, and those of earlier replies.
			got := len(r.Outcomes)
			dst = c.loadResults(dst, r, epoch)
			err = fmt.Errorf("%w: the node answered %d outcomes to %v of %d keys", ErrInvalid, got, t, n)
		}
		if err != nil {
			var slots []Slot
			for _, x := range dst[start:] {
				if x.Found {
					slots = append(slots, x.Slot)
				}
			}
			_ = c.EndLoad(slots)
			return dst[:start], err
		}
		dst = c.loadResults(dst, r, epoch)
		off += n
	}
	return dst, nil
}

// loadResults appends a BeginLoad or Promote reply's results to dst
// (ending the loads of regions not usable here) and gives r back.
func (c *Client) loadResults(dst []LoadResult, r *wire.Msg, epoch uint32) []LoadResult {
	var unusable []Slot
	si := 0
	rv := c.resolverAt(epoch)
	dst = slices.Grow(dst, len(r.Outcomes))
	for _, o := range r.Outcomes {
		dst = append(dst, LoadResult{OnDisk: o == wire.OutcomeOnDisk})
		if o == wire.OutcomeFound {
			res := &dst[len(dst)-1]
			res.Found = rv.put(&res.Slot, &r.Slots[si])
			if !res.Found {
				unusable = append(unusable, res.Slot)
				res.Slot = Slot{}
			}
			si++
		}
	}
	c.done(r)
	if len(unusable) > 0 {
		_ = c.EndLoad(unusable)
	}
	return dst
}

// Delete removes keys from the index (any namespace); it returns how many
// were removed.
func (c *Client) Delete(keys []Key) (int, error) {
	total := 0
	for len(keys) > 0 {
		n := min(len(keys), wire.MaxKeys)
		r, err := c.call(&wire.Msg{Type: wire.TDelete, Keys: keys[:n]}, wire.TOK)
		if err != nil {
			return total, err
		}
		total += int(r.N)
		c.done(r)
		keys = keys[n:]
	}
	return total, nil
}

// Clear removes every block of the client's namespace.
func (c *Client) Clear() (int, error) {
	r, err := c.call(&wire.Msg{Type: wire.TClear}, wire.TOK)
	if err != nil {
		return 0, err
	}
	defer c.done(r)
	return int(r.N), nil
}

// Stats returns the node's state.
func (c *Client) Stats() (Stats, error) {
	var st Stats
	r, err := c.call(&wire.Msg{Type: wire.TStats}, wire.TStatsOK)
	if err != nil {
		return st, err
	}
	defer c.done(r)
	return st, json.Unmarshal(r.JSON, &st)
}

// Trim asks the node to give back at least bytes of its pool (see
// Server.Trim); this client, like every other, is told to unmap the
// regions as they retire.
func (c *Client) Trim(bytes int64) (TrimResult, error) {
	var res TrimResult
	if bytes < 0 {
		return res, fmt.Errorf("%w: trim of %d bytes", ErrInvalid, bytes)
	}
	r, err := c.call(&wire.Msg{Type: wire.TTrim, N: uint64(bytes)}, wire.TTrimOK)
	if err != nil {
		return res, err
	}
	defer c.done(r)
	return res, json.Unmarshal(r.JSON, &res)
}
