package kvcache

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"
)

// propModel drives a Cache with random operations and checks, after every
// step, Verify plus what only the caller can see: handles it holds.
type propModel struct {
	c       *Cache
	writing []Slot // BeginStore slots not yet completed
	loads   []Slot // BeginLoad slots not yet ended
	leases  []Slot // LookupLease slots not yet unleased
	regions map[RegionID]bool
	nextRgn RegionID
	base    uintptr
	// With Config.OnFree: slots written since their last OnFree (by region
	// and offset; region ids are never reused here).
	zeroing bool
	dirty   map[[2]uint64]bool
	// Head-range stores: the clock, and per slot occupancy (id, gen)
	// stored by ranges, the heads committed and when its first range was
	// granted.
	clk       *fakeClock
	committed map[[2]uint32]*[propHeads]bool
	started   map[[2]uint32]time.Time
	// With Config.Demote: the evictions accepted and not yet handed to
	// OnDemote (by occupancy, with their key), and the slots OnDemote was
	// given and Demoted not yet called for.
	accepted map[[2]uint32]Key
	demoting []demotion
}

// propDemoteMax bounds the slots the property test's Demote accepts at
// once (an owner's cap).
const propDemoteMax = 2

// demote is the property test's Config.Demote: called with the lock held
// about a visible block the policy evicts; it accepts some, up to
// propDemoteMax at once.
func (m *propModel) demote(t *rapid.T, s Slot, k Key, needed bool) bool {
	require.False(t, m.c.mu.TryLock(), "Demote called without the cache's lock")
	rec := &m.c.slots[s.ID]
	require.True(t, rec.visible() && rec.gen == s.Gen && rec.key == k, "Demote asked about slot %d gen %d (%v), not a visible block of that key", s.ID, s.Gen, rec.state)
	if needed || (k[0]+byte(s.Gen))%3 == 0 || len(m.accepted)+len(m.demoting) >= propDemoteMax {
		return needed // a needed slot is freed whatever the answer
	}
	m.accepted[occ(s)] = k
	return true
}

// onDemote is the property test's Config.OnDemote: a demoting slot Demote
// accepted, with its key, outside the lock, that no caller holds.
func (m *propModel) onDemote(t *rapid.T, s Slot, k Key) {
	require.True(t, m.c.mu.TryLock(), "OnDemote called with the cache's lock held")
	st, gen := m.c.slots[s.ID].state, m.c.slots[s.ID].gen
	m.c.mu.Unlock()
	require.Equal(t, stateDemoting, st, "slot %d given to OnDemote", s.ID)
	require.Equal(t, s.Gen, gen, "slot %d given to OnDemote", s.ID)
	want, ok := m.accepted[occ(s)]
	require.True(t, ok, "slot %d gen %d demoting without Demote accepting it", s.ID, s.Gen)
	require.Equal(t, want, k, "slot %d demoting with another key", s.ID)
	delete(m.accepted, occ(s))
	for _, l := range [][]Slot{m.writing, m.loads, m.leases} {
		for _, h := range l {
			require.False(t, h.ID == s.ID && h.Gen == s.Gen, "slot %d demoting while a caller holds it", s.ID)
		}
	}
	m.demoting = append(m.demoting, demotion{s, k})
}

// isDemoting reports whether slot id was handed to OnDemote and not
// given back with Demoted.
func (m *propModel) isDemoting(id SlotID) bool {
	for _, d := range m.demoting {
		if d.slot.ID == id {
			return true
		}
	}
	return false
}

// propHeads is the KV heads of propGeo; propTimeout the partial timeout.
const (
	propHeads   = 4
	propTimeout = time.Second
)

// propGeo has 4 KV heads and tiny's 256-byte slots.
var propGeo = Geometry{Layers: 2, KVHeads: propHeads, HeadDim: 2, DTypeBytes: 2, TokensPerBlock: 4}

func occ(s Slot) [2]uint32 { return [2]uint32{uint32(s.ID), s.Gen} }

// requireComplete checks that a visible block stored by head ranges has
// every head committed.
func (m *propModel) requireComplete(t *rapid.T, s Slot) {
	if c, ok := m.committed[occ(s)]; ok {
		for h, done := range c {
			require.True(t, done, "slot %d gen %d visible with head %d not committed", s.ID, s.Gen, h)
		}
	}
}

// checkRangeWrite checks a head-range StoreWrite: a fresh slot, or the
// occupancy other ranges are writing, with heads disjoint from theirs and
// from those committed.
func (m *propModel) checkRangeWrite(t *rapid.T, r StoreResult) (fresh bool) {
	fresh = true
	for _, w := range m.writing {
		if w.ID == r.Slot.ID {
			fresh = false
			require.Equal(t, w.Gen, r.Slot.Gen, "slot %d granted to a new occupancy with a write in flight", w.ID)
			require.False(t, w.Heads.overlaps(r.Slot.Heads) || w.Heads == HeadRange{}, "heads %v granted while %v are written", r.Slot.Heads, w.Heads)
		}
	}
	if c, ok := m.committed[occ(r.Slot)]; ok {
		for h := r.Slot.Heads.First; h < r.Slot.Heads.end(); h++ {
			require.False(t, c[h], "head %d granted again after it was committed", h)
		}
	}
	if fresh {
		if _, ok := m.committed[occ(r.Slot)]; !ok {
			m.committed[occ(r.Slot)] = new([propHeads]bool)
			m.started[occ(r.Slot)] = m.clk.t
		} else {
			fresh = false
		}
	}
	return fresh
}

// onFree is the property test's Config.OnFree: it checks that it runs
// without the cache's lock, on a zeroing slot no caller holds a handle to.
func (m *propModel) onFree(t *rapid.T, s Slot) {
	locked := m.c.zeroingLocked
	if !locked {
		require.True(t, m.c.mu.TryLock(), "OnFree called with the cache's lock held outside zeroHere")
	}
	st, gen := m.c.slots[s.ID].state, m.c.slots[s.ID].gen
	if !locked {
		m.c.mu.Unlock()
	}
	require.Equal(t, stateZeroing, st, "slot %d given to OnFree", s.ID)
	require.False(t, m.isDemoting(s.ID), "slot %d zeroed while demoting", s.ID)
	require.Equal(t, s.Gen, gen, "slot %d given to OnFree", s.ID)
	for _, l := range [][]Slot{m.writing, m.loads, m.leases} {
		for _, h := range l {
			require.False(t, h.ID == s.ID && h.Gen == s.Gen, "slot %d zeroed while a caller holds it", s.ID)
		}
	}
	delete(m.dirty, [2]uint64{uint64(s.Region), s.Off})
}

const propKeys = 48

func (m *propModel) keyChain(t *rapid.T) ([]Key, []int) {
	start := rapid.IntRange(0, propKeys-1).Draw(t, "start")
	n := rapid.IntRange(0, 6).Draw(t, "n")
	var ks []Key
	var ids []int
	for i := 0; i < n && start+i < propKeys; i++ {
		ks = append(ks, key(start+i))
		ids = append(ids, start+i)
	}
	return ks, ids
}

func (m *propModel) outstanding(id SlotID) bool {
	for _, l := range [][]Slot{m.writing, m.loads} {
		for _, s := range l {
			if s.ID == id {
				return true
			}
		}
	}
	return false
}

func pick(t *rapid.T, l *[]Slot, label string) (Slot, bool) {
	if len(*l) == 0 {
		return Slot{}, false
	}
	i := rapid.IntRange(0, len(*l)-1).Draw(t, label)
	s := (*l)[i]
	*l = append((*l)[:i], (*l)[i+1:]...)
	return s, true
}

// requireNothingEvictable checks the condition of a pool-full refusal: no
// free slot, and no ready block the store could have evicted (every ready
// block left belongs to the chain being stored). With Config.OnFree it holds
// as well: a store zeroes the slots it evicted for itself rather than refuse.
func (m *propModel) requireNothingEvictable(t *rapid.T, chain []Key) {
	m.c.mu.Lock()
	defer m.c.mu.Unlock()
	require.Zero(t, m.c.nFree, "store refused as pool full with free slots")
	for i := range m.c.slots {
		if s := &m.c.slots[i]; s.state == stateReady {
			require.Contains(t, chain, s.key, "store refused as pool full while ready slot %d (not in the chain) was evictable", i)
		}
	}
}

func (m *propModel) addRegion(t *rapid.T) {
	slots := rapid.IntRange(1, 6).Draw(t, "regionSlots")
	r := Region{ID: m.nextRgn, Base: m.base, Size: uint64(slots) * 256}
	m.nextRgn++
	m.base += 1 << 20
	n, err := m.c.AddRegion(r)
	require.NoError(t, err)
	require.Equal(t, slots, n)
	m.regions[r.ID] = true
}

func TestPropertyStateMachine(t *testing.T) {
	layout, err := NewLayout(DenseRankSpec(LayerSeparate, propGeo, TokenMajor, HeadRange{}, propKeys, 1<<30))
	require.NoError(t, err)
	require.Equal(t, tinyLayout(t, propKeys).SlotSize(), layout.SlotSize())
	rapid.Check(t, func(t *rapid.T) {
		var p Policy
		switch rapid.IntRange(0, 2).Draw(t, "policy") {
		case 0:
			p = newRandom(rapid.Uint64().Draw(t, "seed"))
		case 1:
			p = newLRU()
		default:
			// Ristretto decides on its own goroutines, so a failing case
			// may not replay exactly; what is checked holds whatever it
			// decides (a refusal for a full pool with an evictable block
			// is a failure under any advice).
			tl, err := NewTinyLFU(TinyLFUConfig{MaxBlocks: 24})
			require.NoError(t, err)
			p = tl
		}
		m := &propModel{regions: map[RegionID]bool{}, nextRgn: 1, base: 1 << 20, dirty: map[[2]uint64]bool{},
			clk: &fakeClock{t: time.Unix(1000, 0)}, committed: map[[2]uint32]*[propHeads]bool{}, started: map[[2]uint32]time.Time{},
			accepted: map[[2]uint32]Key{}}
		cfg := Config{
			Layout: layout, SlotAlign: 256, Policy: p, PartialTimeout: propTimeout, Clock: m.clk.now,
			LowWatermark:   rapid.IntRange(0, 2).Draw(t, "watermark"),
			StoreThreshold: rapid.IntRange(0, 2).Draw(t, "threshold"),
		}
		if m.zeroing = rapid.Bool().Draw(t, "onFree"); m.zeroing {
			cfg.OnFree = func(s Slot) { m.onFree(t, s) }
		}
		if rapid.Bool().Draw(t, "demote") {
			cfg.Demote = func(s Slot, k Key, needed bool) bool { return m.demote(t, s, k, needed) }
			cfg.OnDemote = func(s Slot, k Key) { m.onDemote(t, s, k) }
		}
		c, err := New(cfg)
		require.NoError(t, err)
		defer c.Close()
		m.c = c
		m.addRegion(t)

		t.Repeat(map[string]func(*rapid.T){
			"store": func(t *rapid.T) {
				ks, ids := m.keyChain(t)
				before := c.Stats()
				if len(ks) > 1 && rapid.IntRange(0, 9).Draw(t, "bad") == 0 {
					// Bad input: a duplicate key, a short id slice, an id out of range.
					switch rapid.IntRange(0, 2).Draw(t, "kind") {
					case 0:
						ks[len(ks)-1] = ks[0]
					case 1:
						ids = ids[1:]
					default:
						ids[0] = propKeys
					}
					_, err := c.BeginStore(StoreRequest{Keys: ks, BlockIDs: ids}, nil)
					require.True(t, isAny(err, errDuplicate, errLengthMismatch, errBlockID), "err %v", err)
					require.Equal(t, before, c.Stats())
					return
				}
				req := StoreRequest{Namespace: Namespace(rapid.IntRange(0, 1).Draw(t, "ns")), Keys: ks, BlockIDs: ids}
				if rapid.Bool().Draw(t, "ranged") {
					// A rank of a TP group of 1, 2, 4 or 8 (8: replicated heads).
					tp := 1 << rapid.IntRange(0, 3).Draw(t, "tp")
					req.Heads = rankHeads(propHeads, tp, rapid.IntRange(0, tp-1).Draw(t, "rank"))
				}
				res, err := c.BeginStore(req, nil)
				require.NoError(t, err)
				require.Len(t, res, len(ks))
				for _, r := range res {
					if r.Outcome == StoreRefusedFull {
						m.requireNothingEvictable(t, ks)
					}
					if r.Outcome == StoreWrite {
						ranged := req.Heads != (HeadRange{}) && req.Heads.Count < propHeads
						require.Equal(t, ranged, r.Slot.Heads != (HeadRange{}), "handle heads %v for request heads %v", r.Slot.Heads, req.Heads)
						if ranged && !m.checkRangeWrite(t, r) {
							m.writing = append(m.writing, r.Slot)
							continue // a range joining a partial block
						}
						require.False(t, m.outstanding(r.Slot.ID), "slot %d reused while a transfer is outstanding", r.Slot.ID)
						require.False(t, m.isDemoting(r.Slot.ID), "demoting slot %d handed to a store", r.Slot.ID)
						require.True(t, m.regions[r.Slot.Region], "slot in region %d that is not in the pool", r.Slot.Region)
						at := [2]uint64{uint64(r.Slot.Region), r.Slot.Off}
						require.False(t, m.dirty[at], "slot %d handed out again before OnFree zeroed it", r.Slot.ID)
						if m.zeroing {
							m.dirty[at] = true
						}
						m.writing = append(m.writing, r.Slot)
					}
				}
			},
			"complete": func(t *rapid.T) {
				if s, ok := pick(t, &m.writing, "w"); ok {
					var err error
					if rapid.IntRange(0, 3).Draw(t, "fail") == 0 {
						err = errors.New("copy failed")
					}
					require.NoError(t, c.CompleteStore([]Slot{s}, err))
					require.ErrorIs(t, c.CompleteStore([]Slot{s}, nil), errStaleSlot)
					if cm, ok := m.committed[occ(s)]; ok && err == nil {
						for h := s.Heads.First; h < s.Heads.end(); h++ {
							cm[h] = true
						}
					}
				}
			},
			"lookup": func(t *rapid.T) {
				ks, _ := m.keyChain(t)
				if rapid.Bool().Draw(t, "lease") {
					n, l := c.LookupLease(ks, nil)
					require.Len(t, l, n)
					for _, s := range l {
						m.requireComplete(t, s)
					}
					m.leases = append(m.leases, l...)
				} else {
					require.LessOrEqual(t, c.Lookup(ks), len(ks))
				}
			},
			"unlease": func(t *rapid.T) {
				if s, ok := pick(t, &m.leases, "l"); ok {
					require.NoError(t, c.Unlease([]Slot{s}))
				}
			},
			"beginLoad": func(t *rapid.T) {
				ks, ids := m.keyChain(t)
				res, err := c.BeginLoad(ks, ids, nil)
				require.NoError(t, err)
				for _, r := range res {
					if r.Found {
						m.requireComplete(t, r.Slot)
						m.loads = append(m.loads, r.Slot)
					}
				}
			},
			"endLoad": func(t *rapid.T) {
				if s, ok := pick(t, &m.loads, "e"); ok {
					require.NoError(t, c.EndLoad([]Slot{s}))
				}
			},
			"evict": func(t *rapid.T) {
				n := rapid.IntRange(1, 4).Draw(t, "evict")
				c.mu.Lock()
				if rapid.Bool().Draw(t, "ahead") {
					// Ahead of demand, as the low-watermark does.
					c.watermark += n
					c.maintain(0)
					c.watermark -= n
				} else {
					c.maintain(n + c.nFree)
				}
				c.unlock()
			},
			"demoted": func(t *rapid.T) {
				if len(m.demoting) == 0 {
					return
				}
				i := rapid.IntRange(0, len(m.demoting)-1).Draw(t, "d")
				d := m.demoting[i]
				if rapid.IntRange(0, 4).Draw(t, "stale") == 0 {
					before := c.Stats()
					require.ErrorIs(t, c.Demoted([]Slot{{ID: d.slot.ID, Gen: d.slot.Gen + 1}}), errStaleSlot)
					require.ErrorIs(t, c.Demoted([]Slot{d.slot, d.slot}), errDuplicate)
					require.Equal(t, before, c.Stats())
					return
				}
				m.demoting = append(m.demoting[:i], m.demoting[i+1:]...)
				require.NoError(t, c.Demoted([]Slot{d.slot}))
				require.ErrorIs(t, c.Demoted([]Slot{d.slot}), errStaleSlot)
			},
			"delete": func(t *rapid.T) {
				ks, _ := m.keyChain(t)
				c.Delete(ks)
			},
			"clear": func(t *rapid.T) {
				c.Clear(Namespace(rapid.IntRange(0, 1).Draw(t, "ns")))
			},
			"tick": func(t *rapid.T) {
				m.clk.advance(time.Duration(rapid.Int64Range(0, int64(propTimeout)*3/2).Draw(t, "tick")))
			},
			"expire": func(t *rapid.T) {
				c.ExpirePartials()
				// No block stored by ranges that is older than the timeout
				// is still partial.
				c.mu.Lock()
				defer c.mu.Unlock()
				for o, at := range m.started {
					s := &c.slots[o[0]]
					if s.gen == o[1] && s.part != nil && s.state == stateWriting {
						require.Less(t, m.clk.t.Sub(at), propTimeout, "slot %d gen %d partial for %v", o[0], o[1], m.clk.t.Sub(at))
					}
				}
			},
			"addRegion": func(t *rapid.T) {
				if len(m.regions) < 4 {
					m.addRegion(t)
				}
			},
			"trim": func(t *rapid.T) {
				var ids []RegionID
				for id := range m.regions {
					ids = append(ids, id)
				}
				if len(ids) == 0 {
					return
				}
				id := rapid.SampledFrom(ids).Draw(t, "region")
				if _, err := c.RemoveRegion(id); err != nil {
					require.ErrorIs(t, err, errUnknownRegion) // already draining
				}
			},
			"releasable": func(t *rapid.T) {
				for _, id := range c.TakeReleasable(nil) {
					require.True(t, m.regions[id])
					for _, l := range [][]Slot{m.writing, m.loads, m.leases} {
						for _, s := range l {
							require.NotEqual(t, id, s.Region, "region %d released with a handle outstanding", id)
						}
					}
					for _, d := range m.demoting {
						require.NotEqual(t, id, d.slot.Region, "region %d released with slot %d demoting", id, d.slot.ID)
					}
					delete(m.regions, id)
				}
			},
			"": func(t *rapid.T) {
				require.NoError(t, c.Verify())
				st := c.Stats()
				require.Equal(t, len(m.writing), st.StoresInFlight)
				require.LessOrEqual(t, st.Writing+st.Ready+st.Leased, st.Slots+st.Releasing)
				require.GreaterOrEqual(t, st.Free, 0)
				require.Zero(t, st.Zeroing, "a slot left zeroing after its call returned")
				require.Equal(t, len(m.demoting), st.Demoting, "demoting slots the owner was not given")
				m.requireAcceptedPending(t)
			},
		})
		m.drain(t)
	})
}

// requireAcceptedPending checks that every demotion accepted but not yet
// handed to OnDemote waits for a reader or a transfer (releasing, marked):
// none is lost between the eviction and OnDemote.
func (m *propModel) requireAcceptedPending(t *rapid.T) {
	m.c.mu.Lock()
	defer m.c.mu.Unlock()
	for o := range m.accepted {
		s := &m.c.slots[o[0]]
		require.True(t, s.gen == o[1] && s.state == stateReleasing && s.demote, "accepted demotion of slot %d gen %d lost (%v)", o[0], o[1], s.state)
	}
}

// drain ends a property run: it completes every write, ends every load
// and lease and calls Demoted for every demoting slot (new ones included,
// as ending a load may evict) until none is left, then checks that no
// slot is lost: none releasing, zeroing or demoting, every draining region
// released, and every slot free or holding a block.
func (m *propModel) drain(t *rapid.T) {
	c := m.c
	for len(m.writing)+len(m.loads)+len(m.leases)+len(m.demoting) > 0 {
		w, l, u, d := m.writing, m.loads, m.leases, m.demoting
		m.writing, m.loads, m.leases, m.demoting = nil, nil, nil, nil
		for _, s := range w {
			require.NoError(t, c.CompleteStore([]Slot{s}, nil))
		}
		require.NoError(t, c.EndLoad(l))
		require.NoError(t, c.Unlease(u))
		for _, x := range d {
			require.NoError(t, c.Demoted([]Slot{x.slot}))
		}
	}
	require.Empty(t, m.accepted)
	c.TakeReleasable(nil)
	require.NoError(t, c.Verify())
	st := c.Stats()
	require.Zero(t, st.Releasing+st.Zeroing+st.Demoting+st.Leased)
	require.Equal(t, st.Slots, st.Free+st.Ready+st.Writing, "slots lost: %+v", st)
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, rr := range c.regions {
		require.False(t, rr.draining, "region %d still draining with every slot free", rr.r.ID)
	}
}
