package nodepool

// Serving one request: handle (the requests of the hot path) and
// handleRare (the others), beginStore, settle (recording the leases of a
// leasing Lookup once its reply is sent) and restore, and the slot
// conversions to the wire.
//
// Locks: handle, handleRare, beginStore and restore run with p.mu held
// (serve takes it around handle); settle takes p.mu itself. Under p.mu,
// handleRare takes s.mu (RetireAck, Subscribe, and inside Server.Stats
// and Server.Trim), as does Server.reap: p.mu, then s.mu (peer.go).

import (
	"encoding/json"
	"errors"
	"slices"
	"time"

	"github.com/kvoffload/kvoffload/internal/nodepool/wire"
	"github.com/kvoffload/kvoffload/kvcache"
)

// blockIDs are the block ids the node gives kvcache: a request's keys are
// numbered by position (the node knows no GPU).
var blockIDs = func() []int {
	ids := make([]int, wire.MaxKeys)
	for i := range ids {
		ids[i] = i
	}
	return ids
}()

func toWire(sl kvcache.Slot) wire.Slot {
	return wire.Slot{ID: uint32(sl.ID), Gen: sl.Gen, Region: uint32(sl.Region), Off: sl.Off}
}

// putWire is toWire in place, for the 1024-slot loop of a leasing Lookup
// (a struct returned by value and appended is copied through the stack).
func putWire(d *wire.Slot, sl *kvcache.Slot) {
	d.ID, d.Gen, d.Region, d.Off = uint32(sl.ID), sl.Gen, uint32(sl.Region), sl.Off
}

// handle serves one request and returns its reply.
func (p *peer) handle(m *wire.Msg) *wire.Msg {
	s := p.s
	c := s.cache // set before any peer registers, never changed
	o := &p.out
	o.Reset()
	o.ReqID = m.ReqID
	o.Type = wire.TOK
	ns := kvcache.Namespace(p.ns.id)
	switch m.Type {
	case wire.TLookup:
		o.Type = wire.TLookupOK
		if m.Flags&wire.FlagLease == 0 {
			o.N = uint64(c.Lookup(m.Keys))
			if s.disk != nil {
				s.disk.Saw(m.Keys)
				o.Lower = uint32(s.disk.Prefix(m.Keys[o.N:]))
				s.disk.LookupHits.Add(int64(o.Lower))
			}
			return o
		}
		var n int
		// The policy hears of the hits after the reply is sent (settle):
		// the LRU's moves are off the round trip.
		n, p.slots = c.LookupLeaseDeferred(m.Keys, p.slots[:0])
		if k := p.fitLeases(); k < n {
			// Past the client's share (or a slot's lease count): a
			// shorter prefix is leased.
			if err := c.Unlease(p.slots[k:]); err != nil {
				p.s.counter.internal.Add(1)
			}
			p.slots, n = p.slots[:k], k
		}
		o.N = uint64(n)
		if s.disk != nil {
			s.disk.Saw(m.Keys)
			o.Lower = uint32(s.disk.Prefix(m.Keys[n:]))
			s.disk.LookupHits.Add(int64(o.Lower))
		}
		o.Slots = slices.Grow(o.Slots, len(p.slots))[:len(p.slots)]
		for i := range p.slots {
			putWire(&o.Slots[i], &p.slots[i])
		}
		// Recorded after the reply is sent (settle): the client cannot
		// give them back before it has the reply, and this goroutine
		// reads its next request only after settling.
		p.unsettled = true
	case wire.TUnlease, wire.TEndLoad:
		load := m.Type == wire.TEndLoad
		p.slots = p.slots[:0]
		for i, h := range m.Handles {
			e := p.held.get(h)
			if e == nil || (load && e.loads == 0) || (!load && e.leases == 0) {
				p.restore(m.Handles[:i], load)
				return errMsg(m.ReqID, wire.CodeNotYours, "%v of slot %d gen %d: this client holds no (more) %s on it",
					m.Type, h.ID, h.Gen, map[bool]string{true: "load", false: "lease"}[load])
			}
			if load {
				p.held.dropLoad(e)
			} else {
				p.held.dropLease(e)
			}
			p.slots = appendSlotOf(p.slots, h)
		}
		var err error
		if load {
			err = c.EndLoad(p.slots)
		} else {
			err = c.Unlease(p.slots)
		}
		if err != nil {
			return errMsg(m.ReqID, wire.CodeInternal, "%v: %v", m.Type, err)
		}
		o.N = uint64(len(m.Handles))
		s.reap()
	case wire.TBeginStore:
		return p.beginStore(m, ns)
	case wire.TCommitStore, wire.TAbortStore:
		p.slots = p.slots[:0]
		for i, h := range m.Handles {
			e := p.held.get(h)
			if e == nil || !e.reserved {
				now := time.Now().UnixNano()
				for k, g := range m.Handles[:i] {
					e, _ := p.held.take(g.ID, g.Gen)
					p.held.reserve(e, p.slots[k].Heads, now, nil)
				}
				return errMsg(m.ReqID, wire.CodeNotYours, "%v of slot %d gen %d: this client holds no reservation on it (given twice, another's, or expired after %v)",
					m.Type, h.ID, h.Gen, p.s.lim.reserve)
			}
			p.slots = appendSlotOf(p.slots, h)
			p.slots[len(p.slots)-1].Heads = p.held.unreserve(e)
		}
		var cerr error
		if m.Type == wire.TAbortStore {
			cerr = errAborted
		}
		if err := c.CompleteStore(p.slots, cerr); err != nil {
			return errMsg(m.ReqID, wire.CodeInternal, "%v: %v", m.Type, err)
		}
		o.N = uint64(len(m.Handles))
		s.reap()
	case wire.TBeginLoad:
		var err error
		p.loadRes, err = c.BeginLoad(m.Keys, blockIDs[:len(m.Keys)], p.loadRes[:0])
		if err != nil {
			return errMsg(m.ReqID, wire.CodeInvalid, "BeginLoad: %v", err)
		}
		var onDisk func(j int) bool
		switch {
		case s.disk == nil:
		case m.Flags&wire.FlagDiskLater != 0:
			// Not promoted here: the client asks for them in chunks
			// (Promote), copying each while the next is read.
			onDisk = func(j int) bool { return s.disk.Has(m.Keys[j]) }
		default:
			s.promoteMissing(ns, m.Keys, chainParent(m.Keys), p.loadRes)
		}
		return p.loadReply(o, p.loadRes, onDisk)
	case wire.TPromote:
		// Without a disk tier (with one, serve hands it to the promoter):
		// nothing to read, a BeginLoad answered at once.
		var err error
		p.loadRes, err = c.BeginLoad(m.Keys, blockIDs[:len(m.Keys)], p.loadRes[:0])
		if err != nil {
			return errMsg(m.ReqID, wire.CodeInvalid, "Promote: %v", err)
		}
		return p.loadReply(o, p.loadRes, nil)
	default:
		return p.handleRare(m, o, ns)
	}
	return o
}

// handleRare serves the requests that are not on a serving stack's hot
// path (kept out of handle, whose cases run for every op).
func (p *peer) handleRare(m *wire.Msg, o *wire.Msg, ns kvcache.Namespace) *wire.Msg {
	s := p.s
	c := s.cache
	switch m.Type {
	case wire.TDelete:
		o.N = uint64(c.Delete(m.Keys))
		if s.disk != nil {
			s.disk.Delete(m.Keys)
		}
		s.reap()
	case wire.TClear:
		o.N = uint64(c.Clear(ns))
		if s.disk != nil {
			s.disk.Clear()
		}
		s.reap()
	case wire.TStats:
		b, err := json.Marshal(s.Stats())
		if err != nil {
			return errMsg(m.ReqID, wire.CodeInternal, "stats: %v", err)
		}
		o.Type, o.JSON = wire.TStatsOK, b
	case wire.TTrim:
		res, err := s.Trim(int64(min(m.N, 1<<62)))
		if err != nil {
			return errMsg(m.ReqID, wire.CodeClosed, "%v", err)
		}
		b, _ := json.Marshal(res)
		o.Type, o.JSON = wire.TTrimOK, b
	case wire.TRetireAck:
		s.mu.Lock()
		rr := s.regions[m.Region.ID]
		ok := p.regions[m.Region.ID] && rr != nil && rr.state == regionRetiring
		if ok {
			s.acked(p, m.Region.ID)
		}
		s.mu.Unlock()
		if !ok {
			return errMsg(m.ReqID, wire.CodeNotYours, "RetireAck of region %d: not a region this client was told to unmap", m.Region.ID)
		}
	case wire.TSubscribe:
		s.mu.Lock()
		if !p.subscribed {
			p.subscribed = true
			s.subscribers.Add(1)
		}
		s.mu.Unlock()
	case wire.TBye:
		p.bye = true
	case wire.THello:
		return errMsg(m.ReqID, wire.CodeHandshake, "Hello twice")
	default:
		return errMsg(m.ReqID, wire.CodeMalformed, "%v is not a request", m.Type)
	}
	return o
}

var errAborted = errors.New("nodepool: store aborted by its client")

// settle records the leases a Lookup took, after its reply was sent.
func (p *peer) settle() {
	if !p.unsettled {
		return
	}
	p.unsettled = false
	p.s.cache.Accessed(p.slots)
	p.mu.Lock()
	defer p.mu.Unlock()
	defer func() {
		p.acct.refund(p.grant)
		p.grant = 0
	}()
	for _, sl := range p.slots {
		e, ok := p.held.take(uint32(sl.ID), sl.Gen)
		if !ok {
			// The index never reoccupies a slot this client holds: if it
			// ever did, keep the lease unrecorded (released with the
			// index) rather than mix two generations.
			p.s.counter.internal.Add(1)
			p.s.cfg.Logf("client %d: slot %d leased in generation %d while it holds generation %d", p.id, sl.ID, sl.Gen, e.gen)
			continue
		}
		p.held.addLease(e, &p.grant)
	}
}

// restore gives back the counts taken for handles before a failing one.
func (p *peer) restore(hs []wire.Handle, load bool) {
	for _, h := range hs {
		e, _ := p.held.take(h.ID, h.Gen)
		if load {
			p.held.addLoad(e, nil)
		} else {
			p.held.addLease(e, nil)
		}
	}
}

// beginStore reserves slots for the keys: maximal runs of keys that chain
// (parent of key i is key i-1) go to kvcache as one StoreRequest each.
func (p *peer) beginStore(m *wire.Msg, ns kvcache.Namespace) *wire.Msg {
	c := p.s.cache
	kvHeads := uint16(p.ns.layout.KVHeads)
	// Head ranges: a reservation covers heads [HeadLo, HeadHi) of each
	// block ([0, 0) or [0, KVHeads): the whole block). kvcache keeps the
	// per-range state: a second client's range of a block being written
	// is a write into the same slot, not "present"; the block becomes
	// ready when every head is committed, and one still missing heads
	// after the cache's PartialTimeout (a rank died) is reclaimed. A client
	// holds one range per block (a tensor-parallel rank writes its heads).
	var heads kvcache.HeadRange
	if !(m.HeadLo == 0 && (m.HeadHi == 0 || m.HeadHi == kvHeads)) {
		if m.HeadLo >= m.HeadHi || m.HeadHi > kvHeads {
			return errMsg(m.ReqID, wire.CodeInvalid, "head range [%d, %d): want first < end ≤ %d (the namespace's KV heads)",
				m.HeadLo, m.HeadHi, kvHeads)
		}
		heads = kvcache.HeadRange{First: int(m.HeadLo), Count: int(m.HeadHi - m.HeadLo)}
	}
	o := &p.out
	o.Type = wire.TBeginStoreOK
	keys := m.Keys
	if d := p.s.disk; d != nil && m.HeadLo == 0 {
		// A use of each block, once per tensor-parallel group (the range
		// at head 0), for the disk tier's admission.
		d.Saw(keys)
	}
	var refused map[wire.Key]uint8
	// The client's share: each key written takes one slot of the grant;
	// the index is asked for at most as many keys as are left of it, and
	// once none is left the rest are refused full (the keys of a chain cut
	// short go to the index with the last key given as their parent).
	grant := p.acct.grant(len(keys))
	defer func() { p.acct.refund(grant) }()
	now := time.Now().UnixNano()
	for i := 0; i < len(keys); {
		parent := m.Parent
		switch {
		case m.Flags&wire.FlagChain == 0:
			parent = m.Parents[i]
		case i > 0:
			parent = keys[i-1]
		}
		if out, ok := refused[parent]; ok && parent != (wire.Key{}) {
			// The parent was refused in this call: so is its child.
			o.Outcomes = append(o.Outcomes, out)
			refused[keys[i]] = out
			i++
			continue
		}
		if grant == 0 {
			p.s.counter.overShare.Add(1)
			for range keys[i:] {
				o.Outcomes = append(o.Outcomes, wire.OutcomeRefusedFull)
			}
			break
		}
		j := i + 1
		if m.Flags&wire.FlagChain != 0 {
			j = len(keys)
		} else {
			for j < len(keys) && m.Parents[j] == keys[j-1] {
				j++
			}
		}
		j = min(j, i+grant)
		var err error
		p.storeRes, err = c.BeginStore(kvcache.StoreRequest{Namespace: ns, Parent: parent, Keys: keys[i:j], BlockIDs: blockIDs[i:j], Heads: heads}, p.storeRes[:0])
		if err != nil {
			// Undo this request's reservations: an error leaves nothing held.
			p.slots = p.slots[:0]
			for _, sl := range o.Slots {
				e := p.held.get(sl.Handle())
				ks := slotOf(sl.Handle())
				ks.Heads = p.held.unreserve(e)
				p.slots = append(p.slots, ks)
			}
			if len(p.slots) > 0 {
				_ = c.CompleteStore(p.slots, errAborted)
			}
			return errMsg(m.ReqID, wire.CodeInvalid, "BeginStore: %v", err)
		}
		for k, r := range p.storeRes {
			var out uint8
			switch r.Outcome {
			case kvcache.StoreWrite:
				out = wire.OutcomeWrite
				e, ok := p.held.take(uint32(r.Slot.ID), r.Slot.Gen)
				if !ok || e.reserved {
					return errMsg(m.ReqID, wire.CodeInternal, "slot %d reserved in generation %d while this client holds generation %d", r.Slot.ID, r.Slot.Gen, e.gen)
				}
				p.held.reserve(e, r.Slot.Heads, now, &grant)
				o.Slots = append(o.Slots, toWire(r.Slot))
			case kvcache.StorePresent:
				out = wire.OutcomePresent
			case kvcache.StoreRefusedAdmission:
				out = wire.OutcomeRefusedAdmission
			default:
				out = wire.OutcomeRefusedFull
			}
			if out == wire.OutcomeRefusedFull || out == wire.OutcomeRefusedAdmission {
				if refused == nil {
					refused = map[wire.Key]uint8{}
				}
				refused[keys[i+k]] = out
			}
			o.Outcomes = append(o.Outcomes, out)
		}
		i = j
	}
	return o
}
