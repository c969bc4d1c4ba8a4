package nodepool

// A client's loads: loadReply (recording the loads of a BeginLoad or
// Promote and building its reply), endLoads, and the promoter, the
// goroutine that serves a client's Promote requests in order and in the
// background (queuePromote, promoter, stopPromoter).
//
// Locks: loadReply and endLoads run with p.mu held. The promoter reads
// from the disk tier (Server.promoteMissing) without p.mu and takes p.mu
// to record the loads; queuePromote runs on the serving goroutine, not
// under p.mu.

import (
	"slices"

	"github.com/kvoffload/kvoffload/internal/nodepool/wire"
	"github.com/kvoffload/kvoffload/kvcache"
)

// loadReply records a load on each found result of res (this client's
// BeginLoad of o's request) and fills o, BeginLoadOK: found, or
// OutcomeOnDisk where onDisk (nil: none) says the node's disk holds a key
// not found, or missing. p.mu held.
func (p *peer) loadReply(o *wire.Msg, res []kvcache.LoadResult, onDisk func(j int) bool) *wire.Msg {
	o.Type = wire.TBeginLoadOK
	need := 0
	for _, r := range res {
		if r.Found && p.held.peek(uint32(r.Slot.ID)) == nil {
			need++
		}
	}
	grant := 0
	if need > 0 {
		grant = p.acct.grant(need)
	}
	var over []kvcache.Slot
	defer func() {
		p.acct.refund(grant)
		if len(over) > 0 {
			// Past the client's share, or a slot's load count: missing.
			p.s.counter.overShare.Add(1)
			if err := p.s.cache.EndLoad(over); err != nil {
				p.s.counter.internal.Add(1)
			}
		}
	}()
	for j, r := range res {
		if r.Found {
			if e := p.held.peek(uint32(r.Slot.ID)); (e == nil && grant == 0) || (e != nil && e.loads >= maxSlotReads) {
				over = append(over, r.Slot)
				res[j].Found = false
				r.Found = false
			}
		}
		if !r.Found {
			if onDisk != nil && onDisk(j) {
				o.Outcomes = append(o.Outcomes, wire.OutcomeOnDisk)
			} else {
				o.Outcomes = append(o.Outcomes, wire.OutcomeMissing)
			}
			continue
		}
		e, ok := p.held.take(uint32(r.Slot.ID), r.Slot.Gen)
		if !ok {
			// The index never reoccupies a slot this client holds: if it
			// ever did, the client gets an error and this request holds
			// nothing (the loads recorded so far undone, every load it
			// began ended).
			p.s.counter.internal.Add(1)
			p.endLoads(res, j)
			return errMsg(o.ReqID, wire.CodeInternal, "slot %d loaded in generation %d while this client holds generation %d", r.Slot.ID, r.Slot.Gen, e.gen)
		}
		p.held.addLoad(e, &grant)
		o.Outcomes = append(o.Outcomes, wire.OutcomeFound)
		o.Slots = append(o.Slots, toWire(r.Slot))
	}
	return o
}

// endLoads (mu held) gives back the loads of a load reply that failed at
// result j: those of res[:j] recorded in held are taken out again, and
// every found result's load is ended in the cache.
func (p *peer) endLoads(res []kvcache.LoadResult, j int) {
	var slots []kvcache.Slot
	for i, r := range res {
		if !r.Found {
			continue
		}
		if i < j {
			e, _ := p.held.take(uint32(r.Slot.ID), r.Slot.Gen)
			p.held.dropLoad(e)
		}
		slots = append(slots, r.Slot)
	}
	if err := p.s.cache.EndLoad(slots); err != nil {
		p.s.cfg.Logf("client %d: ending the loads of a failed reply: %v", p.id, err)
	}
}

// chainParent is the parents of keys that form one chain (key j's parent
// key j-1, the first's none): what the promotions of a BeginLoad without
// FlagDiskLater reserve with.
func chainParent(keys []kvcache.Key) func(j int) kvcache.Key {
	return func(j int) kvcache.Key {
		if j == 0 {
			return kvcache.Key{}
		}
		return keys[j-1]
	}
}

// promoteReq is a Promote request for the promoter (its keys copied out
// of the serving goroutine's message).
type promoteReq struct {
	reqID         uint32
	keys, parents []kvcache.Key
}

// promoteQueue bounds the Promote requests of one client waiting for its
// promoter (their keys are held meanwhile); beyond it the serving
// goroutine waits until the promoter takes one, and the client's requests
// behind it wait with it (a chunk's reads at most). The embedded engine
// asks one chunk ahead per Load, so only more than two Loads promoting at
// once through one client reach it.
const promoteQueue = 4

// queuePromote hands a Promote request to the client's promoter, started
// on the first (the serving goroutine, not under mu).
func (p *peer) queuePromote(m *wire.Msg) {
	if p.promoq == nil {
		p.promoq = make(chan promoteReq, promoteQueue)
		p.promoting.Add(1)
		go p.promoter()
	}
	r := promoteReq{reqID: m.ReqID, keys: slices.Clone(m.Keys), parents: slices.Clone(m.Parents)}
	select {
	case p.promoq <- r:
	case <-p.done:
	}
}

// promoter serves a client's Promote requests in order, in the
// background: the disk reads of one do not hold up the client's other
// requests (its EndLoads of the chunk before, its lookups), and the next
// request's reads start as soon as the last ones end. Each promotes the
// keys the pool lacks and the disk holds (Server.promoteMissing, key j's
// parent parents[j]), records the loads of the keys then found under mu,
// and replies BeginLoadOK. After the client disconnected it takes no
// further request; the one in progress finishes its reads and records its
// loads, which release gives back (servePeer waits for the promoter
// first).
func (p *peer) promoter() {
	defer p.promoting.Done()
	s := p.s
	ns := kvcache.Namespace(p.ns.id)
	var o wire.Msg
	var res []kvcache.LoadResult
	for r := range p.promoq {
		select {
		case <-p.done:
			continue
		default:
		}
		o.Reset()
		o.ReqID = r.reqID
		var err error
		res, err = s.cache.BeginLoad(r.keys, blockIDs[:len(r.keys)], res[:0])
		out := &o
		if err != nil {
			out = errMsg(r.reqID, wire.CodeInvalid, "Promote: %v", err)
		} else {
			s.promoteMissing(ns, r.keys, func(j int) kvcache.Key { return r.parents[j] }, res)
			p.mu.Lock()
			out = p.loadReply(&o, res, nil)
			p.mu.Unlock()
		}
		clear(res) // no slot handles kept
		if p.reply(out) != nil {
			p.disconnect()
		}
	}
}

// stopPromoter ends the promoter once the serving goroutine has ended and
// waits for it: what it holds is then in held.
func (p *peer) stopPromoter() {
	if p.promoq != nil {
		close(p.promoq)
	}
	p.promoting.Wait()
}
