package nodepool

// The node's regions as this process maps them: Region, mapping
// (addRegion, and the mapper goroutine for the regions after the first),
// retiring (retire, retireLocal), the resolver from the node's slots to
// this process's addresses, and SlotBytes, Regions, WaitRegions.
//
// Locks: c.mu guards c.regions, c.retired and c.info (RegionErrors); it is
// released before the hooks run and before a region is mapped or
// unmapped. A Region's usable flag is atomic.

import (
	"fmt"
	"sort"
	"sync/atomic"
	"time"

	"github.com/kvoffload/kvoffload/internal/nodepool/wire"
	"github.com/kvoffload/kvoffload/mmapmem"
	"golang.org/x/sys/unix"
)

// Region is one region of the node's pool as this client maps it.
type Region struct {
	ID      uint32
	Base    uintptr // this process's address of the region's first byte
	Size    int64   // bytes
	HugeTLB bool    // hugetlbfs pages back it
	mr      *mmapmem.Region
	epoch   uint32
	usable  atomic.Bool
}

// Bytes is the region's memory in this process.
func (r *Region) Bytes() []byte { return r.mr.Bytes() }

// Mapping is the region's mapping in this process, for pinning it
// (register.Pinner, mlock); the client unmaps it after RegionRetiring.
func (r *Region) Mapping() *mmapmem.Region { return r.mr }

// Epoch is the connection the region came with (Info.Epoch then): the
// node's region ids restart with a new node, so (ID, Epoch) names a region
// for the client's lifetime, as (Slot.Region, Slot.Epoch) names a slot's.
func (r *Region) Epoch() uint32 { return r.epoch }

type retiredKey struct{ id, epoch uint32 }

type regionAdd struct {
	reg   wire.Region
	fd    int
	epoch uint32
}

// addRegion maps a region (populating its page tables in parallel),
// calls Hooks.RegionAdded, and makes it usable.
func (c *Client) addRegion(a regionAdd) {
	if c.cfg.NoMap {
		_ = unix.Close(a.fd)
		return
	}
	mr, err := mmapmem.OpenMemfd(a.fd, int64(a.reg.Size), mmapmem.Options{PrefaultThreads: c.cfg.PrefaultThreads, NoPrefault: c.cfg.NoPrefault})
	if err != nil {
		_ = unix.Close(a.fd)
		c.regionError(fmt.Sprintf("region %d: map: %v", a.reg.ID, err))
		return
	}
	r := &Region{ID: a.reg.ID, Base: mr.Addr(), Size: mr.Len(), HugeTLB: mr.HugeTLB(), mr: mr, epoch: a.epoch}
	if h := c.cfg.Hooks.RegionAdded; h != nil {
		if err := h(r); err != nil {
			_ = mr.Close()
			c.regionError(fmt.Sprintf("region %d: RegionAdded: %v", a.reg.ID, err))
			return
		}
	}
	c.mu.Lock()
	if c.epoch != a.epoch || c.closed || c.retired[retiredKey{r.ID, a.epoch}] {
		c.mu.Unlock()
		c.retireLocal(r)
		return
	}
	c.regions[r.ID] = r
	r.usable.Store(true)
	c.mu.Unlock()
	c.cfg.Logf("region %d mapped: %d bytes at %#x", r.ID, r.Size, r.Base)
}

func (c *Client) regionError(s string) {
	c.mu.Lock()
	c.info.RegionErrors = append(c.info.RegionErrors, s)
	c.mu.Unlock()
	c.cfg.Logf("%s", s)
}

// retireLocal runs the retiring hook and unmaps.
func (c *Client) retireLocal(r *Region) {
	r.usable.Store(false)
	if h := c.cfg.Hooks.RegionRetiring; h != nil {
		h(r)
	}
	_ = r.mr.Close()
}

// mapper maps the regions announced after the first, one at a time.
func (c *Client) mapper() {
	for {
		select {
		case <-c.stop:
			for {
				select {
				case a := <-c.adds:
					_ = unix.Close(a.fd)
				default:
					return
				}
			}
		case a := <-c.adds:
			c.addRegion(a)
		}
	}
}

// retire answers the node's RegionRetire: hook, unmap, acknowledge.
func (c *Client) retire(id, epoch uint32) {
	c.mu.Lock()
	r := c.regions[id]
	if r != nil && r.epoch == epoch {
		delete(c.regions, id)
	} else {
		r = nil
		// Not mapped (yet): the mapper must not map it later.
		c.retired[retiredKey{id, epoch}] = true
	}
	c.mu.Unlock()
	if r != nil {
		c.retireLocal(r)
		c.cfg.Logf("region %d retired", id)
	}
	// Acknowledge a region never mapped here too (its map failed, or it
	// is still queued: the mapper skips it), so that the node can free it.
	_, _ = c.call(&wire.Msg{Type: wire.TRetireAck, Region: wire.Region{ID: id}}, wire.TOK)
}

// resolver turns node slots into this process's addresses, looking a
// region up once per run of slots in it (a reply's slots mostly share a
// few regions).
type resolver struct {
	c        *Client
	epoch    uint32
	slotSize uint64
	noMap    bool
	valid    bool // lastID's fields below are loaded
	lastID   uint32
	usable   bool
	base     uintptr
	size     uint64
}

// resolverAt returns a resolver for connection epoch.
func (c *Client) resolverAt(epoch uint32) resolver {
	c.mu.Lock()
	defer c.mu.Unlock()
	return resolver{c: c, epoch: epoch, slotSize: c.info.SlotSize, noMap: c.cfg.NoMap}
}

func (rv *resolver) load(id uint32) {
	c := rv.c
	c.mu.Lock()
	r := c.regions[id]
	c.mu.Unlock()
	rv.valid, rv.lastID = true, id
	rv.usable = r != nil && r.usable.Load() && r.epoch == rv.epoch
	if rv.usable {
		rv.base, rv.size = r.Base, uint64(r.Size)
	}
}

// put resolves node slot s into *d, this process's slot (its address
// set when its region is usable here); it reports whether the region is
// usable. It fills d's fields in place: a Slot built field by field and
// returned by value was copied whole through the stack, which stalled on
// store forwarding at about 20 ns a slot (20 µs of a 1024-key Lookup).
func (rv *resolver) put(d *Slot, s *wire.Slot) bool {
	d.ID, d.Gen, d.Region, d.Epoch, d.Off, d.Addr = s.ID, s.Gen, s.Region, rv.epoch, s.Off, 0
	if rv.noMap {
		return true // a lease without an address
	}
	if !rv.valid || s.Region != rv.lastID {
		rv.load(s.Region)
	}
	if !rv.usable || s.Off+rv.slotSize > rv.size {
		return false
	}
	d.Addr = rv.base + uintptr(s.Off)
	return true
}

// SlotBytes is the slot's memory in this process (SlotSize bytes at
// s.Addr), or nil when its region is not mapped here (any more). For the
// host backend and tests; a GPU engine copies to and from s.Addr.
func (c *Client) SlotBytes(s Slot) []byte {
	c.mu.Lock()
	r := c.regions[s.Region]
	size := c.info.SlotSize
	c.mu.Unlock()
	if r == nil || r.epoch != s.Epoch || s.Off+size > uint64(r.Size) {
		return nil
	}
	b := r.mr.Bytes()
	if b == nil {
		return nil
	}
	return b[s.Off : s.Off+size : s.Off+size]
}

// Regions lists the regions mapped and usable in this process.
func (c *Client) Regions() []*Region {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]*Region, 0, len(c.regions))
	for _, r := range c.regions {
		if r.usable.Load() {
			out = append(out, r)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// WaitRegions waits until every region the node announced on the current
// connection is mapped and usable here (or failed to map: see
// Info().RegionErrors), at most d; it reports whether they are.
func (c *Client) WaitRegions(d time.Duration) bool {
	if c.cfg.NoMap {
		return true
	}
	deadline := time.Now().Add(d)
	for {
		c.mu.Lock()
		n, want, failed := 0, c.info.announced, len(c.info.RegionErrors)
		for _, r := range c.regions {
			if r.epoch == c.epoch && r.usable.Load() {
				n++
			}
		}
		c.mu.Unlock()
		if n+failed >= want {
			return failed == 0
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
}
