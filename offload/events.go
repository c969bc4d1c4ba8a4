package offload

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/kvoffload/kvoffload/kvcache"
)

// EventKind is vLLM's KV event kind: a block stored, removed, or all
// cleared.
type EventKind uint8

var eventKindNames = [...]string{"", "BlockStored", "BlockRemoved", "AllBlocksCleared"}

// String returns vLLM's name of the event kind, e.g. "BlockStored".
func (k EventKind) String() string {
	if int(k) < len(eventKindNames) && k != 0 {
		return eventKindNames[k]
	}
	return fmt.Sprintf("EventKind(%d)", uint8(k))
}

// Event is one change of the pool's index, sent in order after the fact.
type Event struct {
	Kind        EventKind
	Key, Parent Key      // Parent as the Store gave it (zero: a sequence's start, or unknown)
	Tokens      []uint32 // StoreOptions.Tokens
	BlockSize   int      // the layout's tokens per block
	Medium      string   // MediumCPU, MediumDisk or MediumSharedStorage (no removals)
}

// EventStream delivers events on C; one finding C full is dropped (Dropped).
type EventStream struct {
	C       <-chan Event
	ch      chan Event
	dropped atomic.Int64
	hub     *eventHub
	closed  bool // under hub.mu
}

// Dropped is the number of events this stream lost because C was full.
func (s *EventStream) Dropped() int64 { return s.dropped.Load() }

// Close stops the stream and closes C; safe to call more than once.
func (s *EventStream) Close() {
	s.hub.mu.Lock()
	defer s.hub.mu.Unlock()
	s.hub.removeLocked(s)
}

// defaultEventBuffer is the buffer of an event stream asked for with 0.
const defaultEventBuffer = 1 << 16

// Events subscribes to the index's events, buffering buffer (≤ 0: 65536).
func (e *Engine) Events(buffer int) *EventStream {
	if buffer <= 0 {
		buffer = defaultEventBuffer
	}
	ch := make(chan Event, buffer)
	s := &EventStream{C: ch, ch: ch, hub: &e.hub}
	h := &e.hub
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.done {
		s.closed = true
		close(ch)
		return s
	}
	h.blockSize = e.cfg.Layout.TokensPerBlock
	h.subs = append(h.subs, s)
	h.active.Store(true)
	return s
}

// eventHub fans the cache's index events out to the engine's streams. Its
// lock is taken under the cache's (OnIndex), never the other way round.
type eventHub struct {
	active    atomic.Bool // some stream is open: the store path records parents and tokens
	mu        sync.Mutex
	subs      []*EventStream
	done      bool // the engine closed
	blockSize int
	// pend holds what a Store said about each block it is writing (its
	// parent and tokens), by slot occupancy, until the block is ready
	// (onIndex takes it) or the store ends otherwise (forget).
	pend map[slotGen]pendingBlock
}

type slotGen struct {
	id  kvcache.SlotID
	gen uint32
}

type pendingBlock struct {
	parent Key
	tokens []uint32
}

// checkTokens validates StoreOptions.Tokens: none, or TokensPerBlock per key.
func checkTokens(keys int, tokens []uint32, perBlock int) error {
	if tokens != nil && len(tokens) != keys*perBlock {
		return fmt.Errorf("%w: Store: %d token ids for %d keys of %d tokens (StoreOptions.Tokens needs len(keys) × TokensPerBlock)",
			ErrInvalidArgument, len(tokens), keys, perBlock)
	}
	return nil
}

// noteStore records, while a stream is open, the parent and tokens of the
// blocks a Store is writing (keys[idx[j]] into slots[j]).
func (h *eventHub) noteStore(keys []Key, idx []int, slots []kvcache.Slot, opts StoreOptions, perBlock int) {
	if !h.active.Load() || len(slots) == 0 {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.pend == nil {
		h.pend = map[slotGen]pendingBlock{}
	}
	for j, i := range idx {
		var p pendingBlock
		switch {
		case opts.Parents != nil:
			p.parent = opts.Parents[i]
		case i == 0:
			p.parent = opts.Parent
		default:
			p.parent = keys[i-1]
		}
		if opts.Tokens != nil {
			p.tokens = append([]uint32(nil), opts.Tokens[i*perBlock:(i+1)*perBlock]...)
		}
		h.pend[slotGen{slots[j].ID, slots[j].Gen}] = p
	}
}

// forget drops what noteStore recorded for slots whose store ended
// (CompleteStore returned): nothing is left when their blocks became ready.
func (h *eventHub) forget(slots []kvcache.Slot) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.pend) == 0 {
		return
	}
	for _, s := range slots {
		delete(h.pend, slotGen{s.ID, s.Gen})
	}
}

// onIndex is the cache's Config.OnIndex: under the cache's lock, so the
// events keep the index's order; it never blocks.
func (h *eventHub) onIndex(ev kvcache.IndexEvent) {
	if !h.active.Load() {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	out := Event{Kind: EventRemoved, Key: ev.Key, BlockSize: h.blockSize, Medium: MediumCPU}
	if ev.Ready {
		out.Kind = EventStored
		sg := slotGen{ev.Slot.ID, ev.Slot.Gen}
		if p, ok := h.pend[sg]; ok {
			out.Parent, out.Tokens = p.parent, p.tokens
			delete(h.pend, sg)
		}
	}
	h.sendLocked(out)
}

// onTier publishes a lower tier's change: the disk tier's (internal/tier/disk's
// OnStore and OnRemove, under the store's lock) and the cluster tier's
// (a write-through the cluster stored). It never blocks. Records carry no
// parent or tokens.
func (h *eventHub) onTier(kind EventKind, key Key, medium string) {
	if !h.active.Load() {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.sendLocked(Event{Kind: kind, Key: key, BlockSize: h.blockSize, Medium: medium})
}

func (h *eventHub) sendLocked(ev Event) {
	for _, s := range h.subs {
		select {
		case s.ch <- ev:
		default:
			s.dropped.Add(1)
		}
	}
}

func (h *eventHub) removeLocked(s *EventStream) {
	if s.closed {
		return
	}
	s.closed = true
	close(s.ch)
	for i, x := range h.subs {
		if x == s {
			h.subs = append(h.subs[:i], h.subs[i+1:]...)
			break
		}
	}
	h.active.Store(len(h.subs) > 0)
}

// closeAll ends every stream when the engine closes: the pool is gone, so
// each gets an EventCleared before its channel closes.
func (h *eventHub) closeAll() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.done = true
	h.sendLocked(Event{Kind: EventCleared, BlockSize: h.blockSize, Medium: MediumCPU})
	for len(h.subs) > 0 {
		h.removeLocked(h.subs[0])
	}
	h.pend = nil
}
