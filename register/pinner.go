package register

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvoffload/kvoffload/mmapmem"
)

// Sentinel errors callers can branch on with errors.Is.
var (
	// ErrAlreadyRegistered means the region is already registered with this pinner.
	ErrAlreadyRegistered = errors.New("register: region already registered")
	// ErrNotRegistered means the region is not registered with this pinner.
	ErrNotRegistered = errors.New("register: region not registered")
	// ErrBusy means the region's registration or unregistration is in
	// progress on another goroutine.
	ErrBusy = errors.New("register: region registration in progress")
	// ErrOptions means a pinner was constructed with an invalid option.
	ErrOptions = errors.New("register: invalid options")
)

// Range is one registration range of a region: bytes [Off, Off+Len) of its
// mapping. The last range of a region ends at Region.Mapped, which may be
// beyond Region.Len.
type Range struct{ Off, Len int64 }

// Stats are a pinner's counters, in the spirit of
// torch.cuda.host_memory_stats.
type Stats struct {
	// Regions is the number of regions registered now.
	Regions int
	// RegisteredBytes is the mapped size of the regions registered now;
	// PeakRegisteredBytes its highest value.
	RegisteredBytes     int64
	PeakRegisteredBytes int64
	// RegisterCalls and UnregisterCalls count the calls that reached the
	// pinning layer (successful or not); the Failures count those that failed.
	RegisterCalls      int64
	RegisterFailures   int64
	UnregisterCalls    int64
	UnregisterFailures int64
	// Total and longest time spent pinning and unpinning.
	RegisterTime      time.Duration
	MaxRegisterTime   time.Duration
	UnregisterTime    time.Duration
	MaxUnregisterTime time.Duration
}

// Pinner pins regions. NewCUDA returns its implementation; callers hold
// it as a Pinner. Implementations are safe for concurrent use.
type Pinner interface {
	// Kind names the implementation ("cuda").
	Kind() string
	// Register pins all of r's mapping and holds r so it cannot be closed.
	// On error nothing of r is pinned and r is not held, unless undoing a
	// partial pin failed too: then the ranges still pinned stay registered
	// (Registered and Ranges report them, Unregister retries them) and the
	// error says so.
	Register(r *mmapmem.Region) error
	// Unregister unpins r and drops the hold.
	Unregister(r *mmapmem.Region) error
	// Registered reports whether r is registered with this pinner.
	Registered(r *mmapmem.Region) bool
	// Ranges returns r's registration ranges in order, or nil when r is not
	// registered.
	Ranges(r *mmapmem.Region) []Range
	// Stats returns the pinner's counters.
	Stats() Stats
}

// Release unregisters r from p if it is registered there, then closes it.
func Release(p Pinner, r *mmapmem.Region) error {
	if p.Registered(r) {
		if err := p.Unregister(r); err != nil {
			return err
		}
	}
	return r.Close()
}

// pinFunc pins or unpins ranges of a region. It returns the ranges left
// pinned afterwards (on success: all of them for pin, none for unpin).
type pinFunc func(r *mmapmem.Region, ranges []Range) (pinned []Range, err error)

// tracker is the bookkeeping all pinners share: which regions are
// registered, their holds and ranges, and the stats.
type tracker struct {
	kind  string
	limit func(r *mmapmem.Region) int64
	pin   pinFunc
	unpin pinFunc

	mu      sync.Mutex
	regions map[*mmapmem.Region]*entry
	stats   Stats
}

type entry struct {
	ranges  []Range // nil while the first registration is in progress
	busy    bool
	release func()
}

func newTracker(kind string, limit func(*mmapmem.Region) int64, pin, unpin pinFunc) *tracker {
	return &tracker{kind: kind, limit: limit, pin: pin, unpin: unpin, regions: map[*mmapmem.Region]*entry{}}
}

// Kind implements Pinner.
func (t *tracker) Kind() string { return t.kind }

// split cuts r's mapping into ranges of at most the limit, rounded up to
// r's page size.
func (t *tracker) split(r *mmapmem.Region) []Range {
	limit := t.limit(r)
	if limit <= 0 || limit >= r.Mapped() {
		return []Range{{0, r.Mapped()}}
	}
	limit = (limit + r.PageSize() - 1) / r.PageSize() * r.PageSize()
	var out []Range
	for off := int64(0); off < r.Mapped(); off += limit {
		out = append(out, Range{off, min(limit, r.Mapped()-off)})
	}
	return out
}

func sum(rs []Range) int64 {
	var n int64
	for _, r := range rs {
		n += r.Len
	}
	return n
}

// Register implements Pinner.
func (t *tracker) Register(r *mmapmem.Region) error {
	if r == nil {
		return fmt.Errorf("register: %s: nil region", t.kind)
	}
	t.mu.Lock()
	if e := t.regions[r]; e != nil {
		busy := e.busy
		t.mu.Unlock()
		if busy {
			return fmt.Errorf("%w: %s: %s", ErrBusy, t.kind, r)
		}
		return fmt.Errorf("%w: %s: %s", ErrAlreadyRegistered, t.kind, r)
	}
	release, err := r.Hold(t.kind + " registration")
	if err != nil {
		t.mu.Unlock()
		return fmt.Errorf("register: %s: %w", t.kind, err)
	}
	e := &entry{busy: true, release: release}
	t.regions[r] = e
	t.mu.Unlock()

	ranges := t.split(r)
	start := time.Now()
	pinned, err := t.pin(r, ranges)
	took := time.Since(start)

	t.mu.Lock()
	defer t.mu.Unlock()
	t.stats.RegisterCalls++
	t.stats.RegisterTime += took
	t.stats.MaxRegisterTime = max(t.stats.MaxRegisterTime, took)
	e.busy = false
	if err != nil {
		t.stats.RegisterFailures++
	}
	if len(pinned) == 0 {
		delete(t.regions, r)
		release()
		return err
	}
	e.ranges = pinned
	t.stats.Regions++
	t.stats.RegisteredBytes += sum(pinned)
	t.stats.PeakRegisteredBytes = max(t.stats.PeakRegisteredBytes, t.stats.RegisteredBytes)
	return err
}

// Unregister implements Pinner. If unpinning a range fails, the region stays
// registered with the ranges still pinned, so that it cannot be closed, and
// a later Unregister retries them.
func (t *tracker) Unregister(r *mmapmem.Region) error {
	t.mu.Lock()
	e := t.regions[r]
	switch {
	case e == nil:
		t.mu.Unlock()
		return fmt.Errorf("%w: %s: %s", ErrNotRegistered, t.kind, r)
	case e.busy:
		t.mu.Unlock()
		return fmt.Errorf("%w: %s: %s", ErrBusy, t.kind, r)
	}
	e.busy = true
	ranges := e.ranges
	t.mu.Unlock()

	start := time.Now()
	left, err := t.unpin(r, ranges)
	took := time.Since(start)

	t.mu.Lock()
	defer t.mu.Unlock()
	t.stats.UnregisterCalls++
	t.stats.UnregisterTime += took
	t.stats.MaxUnregisterTime = max(t.stats.MaxUnregisterTime, took)
	e.busy = false
	if err != nil {
		t.stats.UnregisterFailures++
	}
	t.stats.RegisteredBytes -= sum(ranges) - sum(left)
	if len(left) > 0 {
		e.ranges = left
		return err
	}
	t.stats.Regions--
	delete(t.regions, r)
	e.release()
	return err
}

// Registered implements Pinner.
func (t *tracker) Registered(r *mmapmem.Region) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.regions[r]
	return e != nil && e.ranges != nil
}

// Ranges implements Pinner.
func (t *tracker) Ranges(r *mmapmem.Region) []Range {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e := t.regions[r]; e != nil && e.ranges != nil {
		return append([]Range(nil), e.ranges...)
	}
	return nil
}

// Stats implements Pinner.
func (t *tracker) Stats() Stats {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.stats
}
