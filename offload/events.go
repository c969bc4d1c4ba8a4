package offload

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/kvoffload/kvoffload/kvcache"
)

// EventKind says what an Event reports.
type EventKind uint8

// Event kinds, after vLLM's KV events (vllm/distributed/kv_events.py:
// BlockStored, BlockRemoved, AllBlocksCleared).
const (
	// EventStored: the block became ready in the pool (its copy completed
	// and it is visible to lookups).
	EventStored EventKind = iota + 1
	// EventRemoved: the block left the index (evicted by the policy or by
	// Trim, deleted, cleared).
	EventRemoved
	// EventCleared: every block is gone (the engine closed).
	EventCleared
)

var eventKindNames = [...]string{"", "BlockStored", "BlockRemoved", "AllBlocksCleared"}

// String returns vLLM's name of the event kind, e.g. "BlockStored".
func (k EventKind) String() string {
	if int(k) < len(eventKindNames) && k != 0 {
		return eventKindNames[k]
	}
	return fmt.Sprintf("EventKind(%d)", uint8(k))
}

// Event.Medium values: the tier an event is about, spelled as vLLM's CPU
// offloading spells its own ("CPU"), uppercase.
const (
	// MediumCPU: the host pool.
	MediumCPU = "CPU"
	// MediumDisk: the disk tier (Config.Disk). A block written back to
	// disk is an EventStored of this medium (after its host copy's
	// EventRemoved, when the write completes); one evicted from disk,
	// deleted, cleared or dropped there as damaged is an EventRemoved.
	MediumDisk = "DISK"
	// MediumSharedStorage: the cluster tier (Config.Cluster), storage that
	// every engine of the namespace reads, named as llm-d's storage
	// connectors name a shared tier ("SHARED_STORAGE"; its KV-cache scorer
	// weighs that tier below CPU). A block the cluster stored for a
	// write-through is an EventStored of this medium (when the cluster
	// acknowledged it, after the block's EventStored of MediumCPU). Its
	// removal is not announced: the cluster drops records by TTL and by its
	// own eviction, unseen by the engine, and Clear makes the namespace's
	// records unreachable without listing them. A block Prefetch promotes
	// from the cluster (or from disk) is an EventStored of MediumCPU: the
	// event names where the block is, the host pool.
	MediumSharedStorage = "SHARED_STORAGE"
)

// Event is one change of the pool's index, published after the fact: a
// stored block is already ready when its event is sent, a removed block
// already gone from the index. Events of one engine come in the order the
// index changed (a key's EventRemoved never before its EventStored).
type Event struct {
	Kind EventKind
	// Key is the block's key (EventStored, EventRemoved).
	Key Key
	// Parent is the key of the block before it in its sequence, as the
	// Store gave it (StoreOptions.Parent, Parents or the previous key); the
	// zero Key when it starts a sequence or is unknown (EventStored).
	Parent Key
	// Tokens are the block's token ids from StoreOptions.Tokens; nil when
	// the Store gave none (EventStored).
	Tokens []uint32
	// BlockSize is the tokens per block of the layout.
	BlockSize int
	// Medium is the tier the event is about: MediumCPU, MediumDisk or
	// MediumSharedStorage. A block can be in several (a promoted block
	// keeps its disk record; a written-through block stays in the pool).
	Medium string
}

// EventStream receives an engine's events (Engine.Events) on C, a bounded
// channel: the engine never waits for the reader; an event that finds C
// full is dropped and counted (Dropped). C is closed by Close and when the
// engine closes (after an EventCleared, if there is room for it).
type EventStream struct {
	// C delivers the events, in order.
	C <-chan Event

	ch      chan Event
	dropped atomic.Int64
	hub     *eventHub
	closed  bool // under hub.mu
}

// Dropped is the number of events this stream lost because C was full.
func (s *EventStream) Dropped() int64 { return s.dropped.Load() }

// Close stops the stream and closes C (events already in C stay readable).
// Safe to call more than once and after the engine closed.
func (s *EventStream) Close() {
	s.hub.mu.Lock()
	defer s.hub.mu.Unlock()
	s.hub.removeLocked(s)
}

// DefaultEventBuffer is the buffer of an event stream asked for with 0.
const DefaultEventBuffer = 1 << 16

// Events subscribes to the engine's index events: every block stored
// (ready) and removed from now on, in order, on a channel of buffer events
// (DefaultEventBuffer when buffer ≤ 0). Each stream gets every event; a
// slow reader loses events (EventStream.Dropped), it never slows the engine.
// Events of blocks whose Store began before the subscription may lack
// their parent and tokens. After Close it returns a closed stream.
func (e *Engine) Events(buffer int) *EventStream {
	if buffer <= 0 {
		buffer = DefaultEventBuffer
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

// onTier publishes a lower tier's change: the disk tier's (tier/disk's
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
