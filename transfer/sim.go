package transfer

import (
	"errors"
	"fmt"
	"math/rand"
	"sort"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

// SimConfig configures the host simulation.
type SimConfig struct {
	// Seed seeds the delay generator, so a failing run can be replayed.
	Seed int64
	// MinDelay and MaxDelay bound the uniformly random delay before each copy
	// runs on its stream. Zero both for no delay.
	MinDelay, MaxDelay time.Duration
}

// ErrSim is wrapped by errors about the simulation's own objects (unknown
// stream, event or address).
var ErrSim = errors.New("transfer: sim")

// Sim is a Device for machines without a GPU. "Device memory" is anonymous
// mmap'd memory at made-up device addresses; host memory is whatever the
// caller registers with RegisterHost, at its real addresses. Every stream is
// a goroutine executing its operations in order: copies (after a random,
// seeded delay), event records, waits on events, and caller "kernels"
// (Launch) and gates. Streams run independently, so completions arrive out
// of order across streams, as on a GPU. Events follow CUDA's rules: a wait or
// query concerns the most recent record at the time of the call, and an
// event never recorded counts as complete.
//
// Its methods beyond Device let tests play the caller: create streams, record
// events on them, launch functions in stream order, mark a stream capturing,
// and inject driver errors.
type Sim struct {
	cfg SimConfig

	mu      sync.Mutex
	cond    *sync.Cond // broadcast when an event completes or an error is set
	rng     *rand.Rand
	events  map[Event]*simEvent
	streams map[Stream]*simStream
	nextID  uintptr
	engine  [2]Stream
	sticky  error // set by InjectError: returned by every later call
	failCp  error // returned by the next Copy
	closed  bool

	sendMu  sync.RWMutex // held (read) while sending to a stream; Close takes it to close them
	memMu   sync.Mutex   // serialises every access to simulated memory
	host    []simMem     // sorted by base
	dev     []simMem     // sorted by base
	nextDev uint64
}

type simMem struct {
	base uint64
	b    []byte
	mmap bool
}

type simEvent struct{ recorded, done uint64 }

type simStream struct {
	ops       chan func()
	capturing bool
	done      chan struct{}
}

const simDevBase = 1 << 48

// NewSim starts a simulation with its two engine streams.
func NewSim(cfg SimConfig) (*Sim, error) {
	if cfg.MinDelay < 0 || cfg.MaxDelay < cfg.MinDelay {
		return nil, fmt.Errorf("%w: delay bounds [%v, %v] are not 0 ≤ min ≤ max", ErrSim, cfg.MinDelay, cfg.MaxDelay)
	}
	s := &Sim{
		cfg:     cfg,
		rng:     rand.New(rand.NewSource(cfg.Seed)),
		events:  map[Event]*simEvent{},
		streams: map[Stream]*simStream{},
		nextDev: simDevBase,
	}
	s.cond = sync.NewCond(&s.mu)
	s.engine[Load] = s.NewStream()
	s.engine[Store] = s.NewStream()
	return s, nil
}

// NewStream creates a stream (for the engine, or a caller's stream in tests).
func (s *Sim) NewStream() Stream {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.nextID++
	id := Stream(s.nextID)
	st := &simStream{ops: make(chan func(), 4096), done: make(chan struct{})}
	s.streams[id] = st
	go func() {
		defer close(st.done)
		for op := range st.ops {
			op()
		}
	}()
	return id
}

func (s *Sim) stream(id Stream) (*simStream, error) {
	st := s.streams[id]
	if st == nil {
		return nil, fmt.Errorf("%w: unknown stream %#x", ErrSim, uintptr(id))
	}
	return st, nil
}

// enqueue appends op to stream id; s.mu must not be held.
func (s *Sim) enqueue(id Stream, op func()) error {
	s.sendMu.RLock()
	defer s.sendMu.RUnlock()
	s.mu.Lock()
	st, err := s.stream(id)
	if err == nil && s.closed {
		err = fmt.Errorf("%w: closed", ErrSim)
	}
	s.mu.Unlock()
	if err != nil {
		return err
	}
	st.ops <- op
	return nil
}

// SetCapturing marks a caller stream as capturing a graph (or not).
func (s *Sim) SetCapturing(id Stream, on bool) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	st, err := s.stream(id)
	if err != nil {
		return err
	}
	st.capturing = on
	return nil
}

// Launch runs fn in stream order on stream id, like a kernel.
func (s *Sim) Launch(id Stream, fn func()) error { return s.enqueue(id, fn) }

// Gate blocks stream id at this point until the returned func is called.
func (s *Sim) Gate(id Stream) (open func(), err error) {
	ch := make(chan struct{})
	var once sync.Once
	if err := s.enqueue(id, func() { <-ch }); err != nil {
		return nil, err
	}
	return func() { once.Do(func() { close(ch) }) }, nil
}

// eventLocked returns event e, or the sticky error (with sticky set) or an
// unknown-event error. The caller holds s.mu.
func (s *Sim) eventLocked(e Event, sticky bool) (*simEvent, error) {
	if sticky && s.sticky != nil {
		return nil, s.sticky
	}
	ev := s.events[e]
	if ev == nil {
		return nil, fmt.Errorf("%w: unknown event %#x", ErrSim, uintptr(e))
	}
	return ev, nil
}

// RecordEvent records e on any stream.
func (s *Sim) RecordEvent(e Event, id Stream) error {
	s.mu.Lock()
	ev, err := s.eventLocked(e, true)
	if err != nil {
		s.mu.Unlock()
		return err
	}
	ev.recorded++
	target := ev.recorded
	s.mu.Unlock()
	return s.enqueue(id, func() {
		s.mu.Lock()
		if ev.done < target {
			ev.done = target
		}
		s.cond.Broadcast()
		s.mu.Unlock()
	})
}

// StreamWaitEvent makes stream id wait for e's most recent record.
func (s *Sim) StreamWaitEvent(id Stream, e Event) error {
	s.mu.Lock()
	ev, err := s.eventLocked(e, true)
	if err != nil {
		s.mu.Unlock()
		return err
	}
	target := ev.recorded
	s.mu.Unlock()
	return s.enqueue(id, func() {
		s.mu.Lock()
		for ev.done < target && s.sticky == nil {
			s.cond.Wait()
		}
		s.mu.Unlock()
	})
}

// StreamSynchronize blocks until stream id is idle.
func (s *Sim) StreamSynchronize(id Stream) error {
	ch := make(chan struct{})
	if err := s.enqueue(id, func() { close(ch) }); err != nil {
		return err
	}
	<-ch
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sticky
}

// InjectError makes err the context's sticky error: every later call fails
// with it (inject a sticky *cuda.Error to simulate a lost context).
func (s *Sim) InjectError(err error) {
	s.mu.Lock()
	s.sticky = err
	s.cond.Broadcast()
	s.mu.Unlock()
}

// FailNextCopy makes the next Copy fail with err before enqueuing anything.
func (s *Sim) FailNextCopy(err error) {
	s.mu.Lock()
	s.failCp = err
	s.mu.Unlock()
}

// MemAlloc maps n bytes of simulated device memory and returns its address.
func (s *Sim) MemAlloc(n uint64) (uint64, error) {
	if n == 0 || n > 1<<40 {
		return 0, fmt.Errorf("%w: MemAlloc of %d bytes (want 1..1 TiB)", ErrSim, n)
	}
	b, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		return 0, fmt.Errorf("%w: mmap %d bytes: %w", ErrSim, n, err)
	}
	s.memMu.Lock()
	defer s.memMu.Unlock()
	addr := s.nextDev
	s.nextDev += (n + 2<<20 - 1) &^ (2<<20 - 1)
	s.dev = insertMem(s.dev, simMem{base: addr, b: b, mmap: true})
	return addr, nil
}

// MemFree unmaps a MemAlloc allocation.
func (s *Sim) MemFree(addr uint64) error {
	s.memMu.Lock()
	defer s.memMu.Unlock()
	var m simMem
	var err error
	s.dev, m, err = removeMem(s.dev, addr)
	if err != nil {
		return err
	}
	return unix.Munmap(m.b)
}

// RegisterHost makes b addressable by the simulation at its real address,
// which it returns. b must stay valid until UnregisterHost.
func (s *Sim) RegisterHost(b []byte) (uint64, error) {
	if len(b) == 0 {
		return 0, fmt.Errorf("%w: RegisterHost of an empty buffer", ErrSim)
	}
	addr := uint64(uintptr(unsafe.Pointer(&b[0])))
	s.memMu.Lock()
	defer s.memMu.Unlock()
	if i, ok := lookupMem(s.host, addr, 1); ok {
		return 0, fmt.Errorf("%w: host %#x already registered at %#x", ErrSim, addr, s.host[i].base)
	}
	s.host = insertMem(s.host, simMem{base: addr, b: b})
	return addr, nil
}

// UnregisterHost forgets a RegisterHost buffer.
func (s *Sim) UnregisterHost(addr uint64) error {
	s.memMu.Lock()
	defer s.memMu.Unlock()
	var err error
	s.host, _, err = removeMem(s.host, addr)
	return err
}

// Write copies p to simulated memory at addr (host or device).
func (s *Sim) Write(addr uint64, p []byte) error {
	return s.access(addr, uint64(len(p)), func(b []byte) { copy(b, p) })
}

// Read copies simulated memory at addr (host or device) into p.
func (s *Sim) Read(addr uint64, p []byte) error {
	return s.access(addr, uint64(len(p)), func(b []byte) { copy(p, b) })
}

// Fill sets n bytes at addr to v (the poison hook of the gating harness).
func (s *Sim) Fill(addr, n uint64, v byte) error {
	return s.access(addr, n, func(b []byte) {
		for i := range b {
			b[i] = v
		}
	})
}

// access runs f on the memory at [addr, addr+n) with memMu held.
func (s *Sim) access(addr, n uint64, f func([]byte)) error {
	s.memMu.Lock()
	defer s.memMu.Unlock()
	b, err := s.bytes(addr, n)
	if err != nil {
		return err
	}
	f(b)
	return nil
}

// bytes returns the memory at [addr, addr+n); memMu must be held.
func (s *Sim) bytes(addr, n uint64) ([]byte, error) {
	for _, set := range [][]simMem{s.dev, s.host} {
		if i, ok := lookupMem(set, addr, n); ok {
			off := addr - set[i].base
			return set[i].b[off : off+n], nil
		}
	}
	return nil, fmt.Errorf("%w: [%#x,%#x) is not inside simulated memory", ErrSim, addr, addr+n)
}

func lookupMem(set []simMem, addr, n uint64) (int, bool) {
	i := sort.Search(len(set), func(i int) bool { return set[i].base > addr }) - 1
	if i < 0 {
		return 0, false
	}
	size := uint64(len(set[i].b))
	off := addr - set[i].base
	return i, off < size && n <= size-off
}

func insertMem(set []simMem, m simMem) []simMem {
	i := sort.Search(len(set), func(i int) bool { return set[i].base > m.base })
	set = append(set, simMem{})
	copy(set[i+1:], set[i:])
	set[i] = m
	return set
}

func removeMem(set []simMem, addr uint64) ([]simMem, simMem, error) {
	i := sort.Search(len(set), func(i int) bool { return set[i].base >= addr })
	if i == len(set) || set[i].base != addr {
		return set, simMem{}, fmt.Errorf("%w: no simulated memory starts at %#x", ErrSim, addr)
	}
	m := set[i]
	return append(set[:i], set[i+1:]...), m, nil
}

func (s *Sim) delay() time.Duration {
	if s.cfg.MaxDelay == 0 {
		return 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cfg.MinDelay + time.Duration(s.rng.Int63n(int64(s.cfg.MaxDelay-s.cfg.MinDelay)+1))
}

// InitThread implements Device; the simulation needs no thread state.
func (s *Sim) InitThread() error { return nil }

// Copy implements Device. An address that is not mapped when the copy runs
// becomes the sticky illegal-address error, as on a GPU.
func (s *Sim) Copy(dir Direction, segs []Segment) (func(), error) {
	if !dir.valid() {
		return nil, fmt.Errorf("%w: direction %d", ErrSim, int(dir))
	}
	s.mu.Lock()
	err := s.sticky
	if err == nil && s.failCp != nil {
		err, s.failCp = s.failCp, nil
	}
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	own := append([]Segment(nil), segs...)
	d := s.delay()
	err = s.enqueue(s.engine[dir], func() {
		if d > 0 {
			time.Sleep(d)
		}
		s.memMu.Lock()
		defer s.memMu.Unlock()
		for _, g := range own {
			// A strided segment is copied row by row.
			bad := false
			g.rows(func(dev, host, n uint64) {
				src, dst := dev, host
				if dir == Load {
					src, dst = host, dev
				}
				if bad {
					return
				}
				sb, err1 := s.bytes(src, n)
				db, err2 := s.bytes(dst, n)
				if err1 != nil || err2 != nil {
					s.InjectError(&cuda.Error{Op: "sim copy", Code: cuda.ErrorIllegalAddress, Name: "CUDA_ERROR_ILLEGAL_ADDRESS", Text: fmt.Sprintf("copy of %d bytes %#x→%#x touches unmapped memory", n, src, dst)})
					bad = true
					return
				}
				copy(db, sb)
			})
			if bad {
				return
			}
		}
	})
	if err != nil {
		return nil, err
	}
	return func() {}, nil
}

// Record implements Device.
func (s *Sim) Record(dir Direction, e Event) error { return s.RecordEvent(e, s.engine[dir]) }

// Wait implements Device.
func (s *Sim) Wait(dir Direction, e Event) error { return s.StreamWaitEvent(s.engine[dir], e) }

// SyncStream implements Device.
func (s *Sim) SyncStream(dir Direction) error { return s.StreamSynchronize(s.engine[dir]) }

// CreateEvent implements Device (and serves callers' events in tests).
func (s *Sim) CreateEvent(bool) (Event, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.sticky != nil {
		return 0, s.sticky
	}
	s.nextID++
	e := Event(s.nextID)
	s.events[e] = &simEvent{}
	return e, nil
}

// DestroyEvent implements Device.
func (s *Sim) DestroyEvent(e Event) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.eventLocked(e, false); err != nil {
		return err
	}
	delete(s.events, e)
	return nil
}

// Query implements Device.
func (s *Sim) Query(e Event) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ev, err := s.eventLocked(e, true)
	if err != nil {
		return false, err
	}
	return ev.done >= ev.recorded, nil
}

// Sync implements Device.
func (s *Sim) Sync(e Event) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	ev, err := s.eventLocked(e, false)
	if err != nil {
		return err
	}
	target := ev.recorded
	for ev.done < target && s.sticky == nil {
		s.cond.Wait()
	}
	return s.sticky
}

// IsCapturing implements Device.
func (s *Sim) IsCapturing(id Stream) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	st, err := s.stream(id)
	if err != nil {
		return false, err
	}
	return st.capturing, nil
}

// Close stops every stream after its queued work and unmaps device memory.
func (s *Sim) Close() error {
	s.sendMu.Lock()
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		s.sendMu.Unlock()
		return nil
	}
	s.closed = true
	streams := s.streams
	s.mu.Unlock()
	for _, st := range streams {
		close(st.ops)
	}
	s.sendMu.Unlock()
	for _, st := range streams {
		<-st.done
	}
	s.memMu.Lock()
	defer s.memMu.Unlock()
	var err error
	for _, m := range s.dev {
		err = errors.Join(err, unix.Munmap(m.b))
	}
	s.dev, s.host = nil, nil
	return err
}
