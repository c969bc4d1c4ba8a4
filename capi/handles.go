package main

import (
	"fmt"
	"sync"
)

// Handle kinds, kept in a handle's top byte so that a handle of one kind
// passed where another is expected is refused.
const (
	kindEngine uint64 = 0x45 // 'E'
	kindOp     uint64 = 0x4f // 'O'
	kindLease  uint64 = 0x4c // 'L'

	kindShift = 56
	seqMask   = 1<<kindShift - 1
)

// errStale is returned by registry lookups of a handle that was valid once
// and has been released or destroyed since; errUnknown of one that never
// was a handle of the registry's kind.
var (
	errStale   = fmt.Errorf("stale handle")
	errUnknown = fmt.Errorf("unknown handle")
)

// registry maps handles of one kind to Go values. Sequence numbers start at
// 1 and are never reused, so a handle that is absent but not above the last
// one issued was released (errStale) rather than made up (errUnknown).
type registry[T any] struct {
	kind uint64
	name string

	mu   sync.RWMutex
	last uint64
	m    map[uint64]T
}

func newRegistry[T any](kind uint64, name string) *registry[T] {
	return &registry[T]{kind: kind, name: name, m: map[uint64]T{}}
}

// add stores v and returns its new handle.
func (r *registry[T]) add(v T) uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.last++
	h := r.kind<<kindShift | r.last
	r.m[h] = v
	return h
}

// get returns the value of handle h.
func (r *registry[T]) get(h uint64) (T, error) {
	r.mu.RLock()
	v, ok := r.m[h]
	last := r.last
	r.mu.RUnlock()
	if ok {
		return v, nil
	}
	return v, r.missing(h, last)
}

// take removes handle h and returns its value; of several concurrent takes
// of one handle exactly one succeeds.
func (r *registry[T]) take(h uint64) (T, error) {
	r.mu.Lock()
	v, ok := r.m[h]
	if ok {
		delete(r.m, h)
	}
	last := r.last
	r.mu.Unlock()
	if ok {
		return v, nil
	}
	return v, r.missing(h, last)
}

func (r *registry[T]) missing(h, last uint64) error {
	seq := h & seqMask
	if h>>kindShift == r.kind && seq >= 1 && seq <= last {
		return fmt.Errorf("%w: %s handle %#x was released", errStale, r.name, h)
	}
	return fmt.Errorf("%w: %#x is not a %s handle", errUnknown, h, r.name)
}

// restore puts back a value taken from handle h (a call that took it
// failed and gives it back to its owner).
func (r *registry[T]) restore(h uint64, v T) {
	r.mu.Lock()
	r.m[h] = v
	r.mu.Unlock()
}

// len is the number of live handles.
func (r *registry[T]) len() int {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return len(r.m)
}
