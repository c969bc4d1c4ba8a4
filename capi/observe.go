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
	"errors"
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
// stream is set before the eventSub is published in eventSubs and never
// changes: a concurrent call finds either no subscription or a whole one.
type eventSub struct {
	stream *offload.EventStream

	mu      sync.Mutex
	pending []byte
}

var eventSubs sync.Map // engine handle (uint64) → *eventSub

// maxPollEvents bounds the events of one kvo_events_poll.
const maxPollEvents = 4096

//export kvoGo_events_open
func kvoGo_events_open(h C.uint64_t, buffer C.int64_t) (rc C.int) {
	defer guard(&rc)
	if err := eventsOpen(uint64(h), int64(buffer)); err != nil {
		return fail(err)
	}
	return codeOK
}

// errNoStream and errStreamOpen are the event calls' documented
// KVO_EINVAL cases: no kvo_events_open (or closed since, by another
// thread too), and a second open.
var (
	errNoStream   = errors.New("no event stream (call kvo_events_open first)")
	errStreamOpen = errors.New("the engine's event stream is already open")
)

// eventsOpen subscribes engine handle h to its engine's events. The
// subscription is built whole (its stream made) before it is published,
// so a concurrent poll, dropped, close or destroy never sees a part of
// one. An engine destroyed meanwhile (its handle taken between the lookup
// and the publication) gets no subscription that outlives it: the one
// published is withdrawn and closed, here or by the destroy's dropEvents
// (whichever removes it closes it), and the call is KVO_ECLOSED.
func eventsOpen(h uint64, buffer int64) error {
	eng, err := engine(C.uint64_t(h))
	if err != nil {
		return err
	}
	if buffer < 0 || buffer > 1<<30 {
		return fmt.Errorf("%w: kvo_events_open: buffer %d outside [0, 2^30]", offload.ErrInvalidArgument, buffer)
	}
	if _, ok := eventSubs.Load(h); ok {
		return fmt.Errorf("%w: kvo_events_open: %w", offload.ErrInvalidArgument, errStreamOpen)
	}
	sub := &eventSub{stream: eng.Events(int(buffer))}
	if _, loaded := eventSubs.LoadOrStore(h, sub); loaded {
		sub.stream.Close()
		return fmt.Errorf("%w: kvo_events_open: %w", offload.ErrInvalidArgument, errStreamOpen)
	}
	if _, err := engine(C.uint64_t(h)); err != nil {
		if eventSubs.CompareAndDelete(h, sub) {
			sub.stream.Close()
		}
		return err
	}
	return nil
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

func subOf(h uint64, call string) (*eventSub, error) {
	if _, err := engine(C.uint64_t(h)); err != nil {
		return nil, err
	}
	v, ok := eventSubs.Load(h)
	if !ok {
		return nil, fmt.Errorf("%w: %s: %w", offload.ErrInvalidArgument, call, errNoStream)
	}
	return v.(*eventSub), nil
}

//export kvoGo_events_poll
func kvoGo_events_poll(h C.uint64_t, buf *C.char, capacity C.size_t, needed *C.size_t) (rc C.int) {
	defer guard(&rc)
	rc = codeOK
	err := eventsPoll(uint64(h), func(b []byte) bool {
		rc = writeString(b, buf, capacity, needed)
		return rc == codeOK
	})
	if err != nil {
		return fail(err)
	}
	return rc
}

// eventsPoll takes the events waiting on h's stream (at most
// maxPollEvents) as a JSON array and hands it to deliver, under the
// subscription's lock; a batch deliver refuses (the caller's buffer too
// small) is kept for the next poll. A stream closed meanwhile (by
// kvo_events_close or kvo_engine_destroy on another thread) gives what it
// still held, then "[]".
func eventsPoll(h uint64, deliver func([]byte) bool) error {
	sub, err := subOf(h, "kvo_events_poll")
	if err != nil {
		return err
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
			return fmt.Errorf("kvoffload: encoding events: %w", err)
		}
		sub.pending = b
	}
	if deliver(sub.pending) {
		sub.pending = nil
	}
	return nil
}

//export kvoGo_events_dropped
func kvoGo_events_dropped(h C.uint64_t, dropped *C.uint64_t) (rc C.int) {
	defer guard(&rc)
	n, err := eventsDropped(uint64(h), dropped != nil)
	if err != nil {
		return fail(err)
	}
	*dropped = C.uint64_t(n)
	return codeOK
}

// eventsDropped is the count of events h's stream dropped; out says
// whether the caller gave somewhere to put it.
func eventsDropped(h uint64, out bool) (int64, error) {
	sub, err := subOf(h, "kvo_events_dropped")
	if err != nil {
		return 0, err
	}
	if !out {
		return 0, fmt.Errorf("%w: kvo_events_dropped: dropped is NULL", offload.ErrInvalidArgument)
	}
	return sub.stream.Dropped(), nil
}

//export kvoGo_events_close
func kvoGo_events_close(h C.uint64_t) (rc C.int) {
	defer guard(&rc)
	if err := eventsClose(uint64(h)); err != nil {
		return fail(err)
	}
	return codeOK
}

// eventsClose closes h's stream. Of concurrent closes (and a destroy) of
// one subscription exactly one removes and closes it; the others find no
// stream (KVO_EINVAL, as after a close) or the engine destroyed
// (KVO_ECLOSED).
func eventsClose(h uint64) error {
	sub, err := subOf(h, "kvo_events_close")
	if err != nil {
		return err
	}
	if !eventSubs.CompareAndDelete(h, sub) {
		return fmt.Errorf("%w: kvo_events_close: %w (closed by another call)", offload.ErrInvalidArgument, errNoStream)
	}
	sub.stream.Close()
	return nil
}

// dropEvents forgets an engine handle's stream (kvo_engine_destroy).
func dropEvents(h uint64) {
	if v, ok := eventSubs.LoadAndDelete(h); ok {
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
