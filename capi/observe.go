//go:build cgo

package main

/*
#include <stddef.h>
#include <stdint.h>
*/
import "C"

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"sync"
	"unsafe"

	"github.com/kvoffload/kvoffload/metrics"
	"github.com/kvoffload/kvoffload/offload"
)

// Metrics and KV events (kvo_metrics_text, kvo_events_*): views of the
// engine that the core package leaves to metrics/ and to Engine.Events.

//export kvoGo_metrics_text
func kvoGo_metrics_text(h C.uint64_t, buf *C.char, capacity C.size_t, needed *C.size_t) (rc C.int) {
	defer guard(&rc)
	eng, err := engine(h)
	if err != nil {
		return fail(err)
	}
	var b bytes.Buffer
	if err := metrics.WriteText(&b, eng); err != nil {
		return fail(fmt.Errorf("kvoffload: metrics: %w", err))
	}
	return writeString(b.Bytes(), buf, capacity, needed)
}

// writeString copies b into buf with a NUL; *needed gets len(b)+1.
func writeString(b []byte, buf *C.char, capacity C.size_t, needed *C.size_t) C.int {
	if needed != nil {
		*needed = C.size_t(len(b) + 1)
	}
	if buf == nil || uint64(capacity) < uint64(len(b)+1) {
		return failf("buffer of %d bytes, the text needs %d", uint64(capacity), len(b)+1)
	}
	out := unsafe.Slice((*byte)(unsafe.Pointer(buf)), len(b)+1)
	copy(out, b)
	out[len(b)] = 0
	return codeOK
}

// eventSub is an engine handle's event stream and the batch a poll
// encoded but could not hand over (the caller's buffer was too small).
type eventSub struct {
	mu      sync.Mutex
	stream  *offload.EventStream
	pending []byte
}

var eventSubs sync.Map // engine handle (uint64) → *eventSub

// maxPollEvents bounds the events of one kvo_events_poll.
const maxPollEvents = 4096

//export kvoGo_events_open
func kvoGo_events_open(h C.uint64_t, buffer C.int64_t) (rc C.int) {
	defer guard(&rc)
	eng, err := engine(h)
	if err != nil {
		return fail(err)
	}
	if buffer < 0 || buffer > 1<<30 {
		return failf("kvo_events_open: buffer %d outside [0, 2^30]", int64(buffer))
	}
	sub := &eventSub{}
	if _, loaded := eventSubs.LoadOrStore(uint64(h), sub); loaded {
		return failf("kvo_events_open: the engine's event stream is already open")
	}
	sub.stream = eng.Events(int(buffer))
	return codeOK
}

// eventJSON is one event as kvo_events_poll writes it: vLLM's field names,
// block hashes as 32 hex digits.
type eventJSON struct {
	Type        string    `json:"type"`
	BlockHashes []string  `json:"block_hashes,omitempty"`
	Parent      *string   `json:"parent_block_hash,omitempty"`
	TokenIDs    *[]uint32 `json:"token_ids,omitempty"` // BlockStored only, [] when none
	BlockSize   int       `json:"block_size,omitempty"`
	Medium      string    `json:"medium,omitempty"`
}

func toJSON(ev offload.Event) eventJSON {
	out := eventJSON{Type: ev.Kind.String()}
	if ev.Kind == offload.EventCleared {
		return out
	}
	out.BlockHashes, out.Medium = []string{hex.EncodeToString(ev.Key[:])}, ev.Medium
	if ev.Kind == offload.EventStored {
		if ev.Parent != (offload.Key{}) {
			p := hex.EncodeToString(ev.Parent[:])
			out.Parent = &p
		}
		toks := ev.Tokens
		if toks == nil {
			toks = []uint32{}
		}
		out.TokenIDs, out.BlockSize = &toks, ev.BlockSize
	}
	return out
}

func subOf(h C.uint64_t, call string) (*eventSub, error) {
	if _, err := engine(h); err != nil {
		return nil, err
	}
	v, ok := eventSubs.Load(uint64(h))
	if !ok {
		return nil, fmt.Errorf("%w: %s: no event stream (call kvo_events_open first)", offload.ErrInvalidArgument, call)
	}
	return v.(*eventSub), nil
}

//export kvoGo_events_poll
func kvoGo_events_poll(h C.uint64_t, buf *C.char, capacity C.size_t, needed *C.size_t) (rc C.int) {
	defer guard(&rc)
	sub, err := subOf(h, "kvo_events_poll")
	if err != nil {
		return fail(err)
	}
	sub.mu.Lock()
	defer sub.mu.Unlock()
	if sub.pending == nil {
		evs := []eventJSON{}
	take:
		for len(evs) < maxPollEvents {
			select {
			case ev, ok := <-sub.stream.C:
				if !ok {
					break take
				}
				evs = append(evs, toJSON(ev))
			default:
				break take
			}
		}
		b, err := json.Marshal(evs)
		if err != nil {
			return fail(fmt.Errorf("kvoffload: encoding events: %w", err))
		}
		sub.pending = b
	}
	if rc := writeString(sub.pending, buf, capacity, needed); rc != codeOK {
		return rc // kept for the next call, with a larger buffer
	}
	sub.pending = nil
	return codeOK
}

//export kvoGo_events_dropped
func kvoGo_events_dropped(h C.uint64_t, dropped *C.uint64_t) (rc C.int) {
	defer guard(&rc)
	sub, err := subOf(h, "kvo_events_dropped")
	if err != nil {
		return fail(err)
	}
	if dropped == nil {
		return failf("kvo_events_dropped: dropped is NULL")
	}
	*dropped = C.uint64_t(sub.stream.Dropped())
	return codeOK
}

//export kvoGo_events_close
func kvoGo_events_close(h C.uint64_t) (rc C.int) {
	defer guard(&rc)
	sub, err := subOf(h, "kvo_events_close")
	if err != nil {
		return fail(err)
	}
	eventSubs.Delete(uint64(h))
	sub.stream.Close()
	return codeOK
}

// dropEvents forgets an engine handle's stream (kvo_engine_destroy).
func dropEvents(h C.uint64_t) {
	if v, ok := eventSubs.LoadAndDelete(uint64(h)); ok {
		v.(*eventSub).stream.Close()
	}
}

//export kvoGo_store_tokens
func kvoGo_store_tokens(h C.uint64_t, keysP *C.uint8_t, idsP *C.int64_t, n C.size_t, parentP, parentsP *C.uint8_t, tokensP *C.uint32_t, nTokens C.size_t, afterEvent, afterStream C.uintptr_t, opOut *C.uint64_t) (rc C.int) {
	defer guard(&rc)
	eng, keys, ids, err := opArgs("kvo_store_tokens", h, keysP, idsP, n, opOut)
	if err != nil {
		return fail(err)
	}
	parent, parents, err := storeParents(parentP, parentsP, n)
	if err != nil {
		return fail(err)
	}
	var tokens []uint32
	if nTokens > 0 {
		if tokensP == nil {
			return failf("kvo_store_tokens: tokens is NULL with n_tokens = %d", uint64(nTokens))
		}
		if uint64(nTokens) > uint64(n)*(1<<20) {
			return failf("kvo_store_tokens: %d tokens for %d keys", uint64(nTokens), uint64(n))
		}
		tokens = append([]uint32(nil), unsafe.Slice((*uint32)(unsafe.Pointer(tokensP)), int(nTokens))...)
	}
	op, err := eng.Store(context.Background(), keys, ids, offload.StoreOptions{After: uintptr(afterEvent), AfterStream: uintptr(afterStream),
		Parent: parent, Parents: parents, Tokens: tokens})
	if err != nil {
		return fail(err)
	}
	*opOut = C.uint64_t(ops.add(op))
	return codeOK
}
