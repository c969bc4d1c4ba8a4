package kvcache

import (
	"errors"
	"testing"

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
	layout := tinyLayout(t, propKeys)
	rapid.Check(t, func(t *rapid.T) {
		var p Policy
		switch rapid.IntRange(0, 2).Draw(t, "policy") {
		case 0:
			p = NewRandom(rapid.Uint64().Draw(t, "seed"))
		case 1:
			p = NewLRU()
		default:
			// Ristretto decides on its own goroutines, so a failing case
			// may not replay exactly; what is checked holds whatever it
			// decides (a refusal for a full pool with an evictable block
			// is a failure under any advice).
			tl, err := NewTinyLFU(TinyLFUConfig{MaxBlocks: 24})
			require.NoError(t, err)
			p = tl
		}
		m := &propModel{regions: map[RegionID]bool{}, nextRgn: 1, base: 1 << 20, dirty: map[[2]uint64]bool{}}
		cfg := Config{
			Layout: layout, SlotAlign: 256, Policy: p,
			LowWatermark:   rapid.IntRange(0, 2).Draw(t, "watermark"),
			StoreThreshold: rapid.IntRange(0, 2).Draw(t, "threshold"),
		}
		if m.zeroing = rapid.Bool().Draw(t, "onFree"); m.zeroing {
			cfg.OnFree = func(s Slot) { m.onFree(t, s) }
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
					require.True(t, isAny(err, ErrDuplicate, ErrLengthMismatch, ErrBlockID), "err %v", err)
					require.Equal(t, before, c.Stats())
					return
				}
				res, err := c.BeginStore(StoreRequest{Namespace: Namespace(rapid.IntRange(0, 1).Draw(t, "ns")), Keys: ks, BlockIDs: ids}, nil)
				require.NoError(t, err)
				require.Len(t, res, len(ks))
				for _, r := range res {
					if r.Outcome == StoreRefusedFull {
						m.requireNothingEvictable(t, ks)
					}
					if r.Outcome == StoreWrite {
						require.False(t, m.outstanding(r.Slot.ID), "slot %d reused while a transfer is outstanding", r.Slot.ID)
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
					require.ErrorIs(t, c.CompleteStore([]Slot{s}, nil), ErrStaleSlot)
				}
			},
			"lookup": func(t *rapid.T) {
				ks, _ := m.keyChain(t)
				if rapid.Bool().Draw(t, "lease") {
					n, l := c.LookupLease(ks, nil)
					require.Len(t, l, n)
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
				c.maintain(n + c.nFree)
				c.unlock()
			},
			"delete": func(t *rapid.T) {
				ks, _ := m.keyChain(t)
				c.Delete(ks)
			},
			"clear": func(t *rapid.T) {
				c.Clear(Namespace(rapid.IntRange(0, 1).Draw(t, "ns")))
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
					require.ErrorIs(t, err, ErrUnknownRegion) // already draining
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
			},
		})
	})
}
