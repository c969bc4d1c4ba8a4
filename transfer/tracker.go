package transfer

import (
	"errors"
	"fmt"
	"hash/maphash"
	"sort"
	"sync"
)

// InvariantsEnabled reports whether this build checks gating invariants
// (under -race or the kvoinvariants build tag). When false, Tracker methods
// do nothing and cost nothing.
func InvariantsEnabled() bool { return invariantsEnabled }

// ErrInvariant is wrapped by every gating violation a Tracker records.
var ErrInvariant = errors.New("transfer: gating invariant violated")

// PoisonByte is written over host ranges when they are released.
const PoisonByte = 0xA5

// Tracker is the gating harness. The owner of the host slots (kvcache, via
// offload) declares ranges live before it submits copies on them and
// released when it frees them; in invariant builds released ranges are
// poisoned, and the scheduler checks, when each copy is submitted and again
// when it completes, that every host range it touches was live the whole
// time (the same declaration at both ends). Violations are recorded, not
// panicked, so tests can assert that a broken gating is caught.
type Tracker struct {
	poison func(addr, n uint64)

	mu         sync.Mutex
	gen        uint64
	live       []liveRange // sorted by base, disjoint
	violations []error
}

type liveRange struct{ base, end, gen uint64 }

// NewTracker returns a Tracker that poisons released ranges with poison
// (called with the range; nil: no poisoning).
func NewTracker(poison func(addr, n uint64)) *Tracker {
	return &Tracker{poison: poison}
}

// Live declares [addr, addr+n) live: a copy may use it until Released.
func (t *Tracker) Live(addr, n uint64) error {
	if !invariantsEnabled {
		return nil
	}
	if n == 0 || addr+n < addr {
		return fmt.Errorf("%w: live range %#x+%d is empty or wraps", ErrInvalidRequest, addr, n)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	i := sort.Search(len(t.live), func(i int) bool { return t.live[i].base >= addr })
	if (i > 0 && t.live[i-1].end > addr) || (i < len(t.live) && t.live[i].base < addr+n) {
		return fmt.Errorf("%w: live range [%#x,%#x) overlaps one already live", ErrInvalidRequest, addr, addr+n)
	}
	t.gen++
	t.live = append(t.live, liveRange{})
	copy(t.live[i+1:], t.live[i:])
	t.live[i] = liveRange{base: addr, end: addr + n, gen: t.gen}
	return nil
}

// Released declares [addr, addr+n), exactly as given to Live, released, and
// poisons it.
func (t *Tracker) Released(addr, n uint64) error {
	if !invariantsEnabled {
		return nil
	}
	t.mu.Lock()
	i := sort.Search(len(t.live), func(i int) bool { return t.live[i].base >= addr })
	if i == len(t.live) || t.live[i].base != addr || t.live[i].end != addr+n {
		t.mu.Unlock()
		return fmt.Errorf("%w: released range [%#x,%#x) was not declared live", ErrInvalidRequest, addr, addr+n)
	}
	t.live = append(t.live[:i], t.live[i+1:]...)
	t.mu.Unlock()
	if t.poison != nil {
		t.poison(addr, n)
	}
	return nil
}

// Violations returns the violations recorded so far.
func (t *Tracker) Violations() []error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([]error(nil), t.violations...)
}

func (t *Tracker) violate(err error) {
	t.mu.Lock()
	t.violations = append(t.violations, err)
	t.mu.Unlock()
}

// gens returns the generation of the live range holding each segment's host
// side (0 where none), recording a violation for each segment not live.
func (t *Tracker) gens(when string, dir Direction, segs []placed, want []uint64) []uint64 {
	out := make([]uint64, len(segs))
	t.mu.Lock()
	defer t.mu.Unlock()
	for k, s := range segs {
		n := s.hostExtent()
		i := sort.Search(len(t.live), func(i int) bool { return t.live[i].base > s.Host }) - 1
		if i >= 0 && s.Host+n <= t.live[i].end {
			out[k] = t.live[i].gen
		}
		switch {
		case out[k] == 0:
			t.violations = append(t.violations, fmt.Errorf("%w: %s %s: host [%#x,%#x) is not live", ErrInvariant, dir, when, s.Host, s.Host+n))
		case want != nil && want[k] != 0 && want[k] != out[k]:
			t.violations = append(t.violations, fmt.Errorf("%w: %s %s: host [%#x,%#x) was released and reused during the copy", ErrInvariant, dir, when, s.Host, s.Host+n))
		}
	}
	return out
}

// descHash fingerprints a batch's descriptor buffer so that reuse before
// the batch's event retires is detected at completion.
func descHash(seed maphash.Seed, segs []Segment) uint64 {
	var h maphash.Hash
	h.SetSeed(seed)
	for _, s := range segs {
		maphash.WriteComparable(&h, s)
	}
	return h.Sum64()
}
