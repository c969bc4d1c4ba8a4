package cudadev

import (
	"errors"
	"fmt"
	"sync"
	"time"
	"unsafe"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
	"github.com/kvoffload/kvoffload/transfer"
)

// SimConfig configures the host simulation.
type SimConfig struct {
	// Seed seeds the delay generator, so a failing run can be replayed.
	Seed int64
	// MinDelay and MaxDelay bound the uniformly random delay before each copy
	// (and each Launch) runs on its stream. Zero both for no delay.
	MinDelay, MaxDelay time.Duration
}

// ErrSim is wrapped by errors about the simulation's own objects (unknown
// address, bad arguments).
var ErrSim = errors.New("transfer: sim")

// simDeviceMemory is the fake device's capacity: address space only (the
// fake maps its allocations with MAP_NORESERVE), so tests are bounded by
// what they touch.
const simDeviceMemory = 1 << 42

// Sim is a Device for machines without a GPU: the CUDA device of this
// package over the fake driver (internal/cuda/cudafake), the one GPU
// simulator of the module. "Device memory" is the fake's anonymous
// mappings; host memory is whatever the caller registers with
// RegisterHost, at its real addresses. Every stream is a goroutine running
// its work in order: copies (through the copy kernels the fake runs in Go,
// after a random, seeded delay), event records, waits, and caller
// "kernels" (Launch) and gates. Streams run independently, so completions
// arrive out of order across streams, as on a GPU; events follow CUDA's
// rules (a wait or query concerns the most recent record at the time of
// the call, an event never recorded counts as complete).
//
// Its methods beyond Device let tests play the caller: create streams,
// record events on them, launch functions in stream order, mark a stream
// capturing, and inject driver errors.
type Sim struct {
	drv *cudafake.Driver
	cu  *CUDA

	mu        sync.Mutex
	failCp    error
	hosts     map[uint64][]byte            // RegisterHost's buffers by address
	capturing map[transfer.Stream]struct{} // SetCapturing's streams
	closed    bool
}

// NewSim starts a simulation with its engine streams.
func NewSim(cfg SimConfig) (*Sim, error) {
	if cfg.MinDelay < 0 || cfg.MaxDelay < cfg.MinDelay {
		return nil, fmt.Errorf("%w: delay bounds [%v, %v] are not 0 ≤ min ≤ max", ErrSim, cfg.MinDelay, cfg.MaxDelay)
	}
	drv := cudafake.New(cudafake.Options{Seed: uint64(cfg.Seed), CopyMinDelay: cfg.MinDelay, CopyMaxDelay: cfg.MaxDelay,
		DeviceMemory: simDeviceMemory})
	ctx, err := drv.PrimaryCtxRetain(0)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("%w: %w", ErrSim, err), drv.Close())
	}
	// The copy kernels, uncalibrated (the rule the fake's timings would
	// not make better).
	cu, err := newCUDA(drv, 0, ctx, cudacopy.Options{Calibration: &cudacopy.Calibration{}})
	if err != nil {
		return nil, errors.Join(fmt.Errorf("%w: %w", ErrSim, err), drv.PrimaryCtxRelease(0), drv.Close())
	}
	return &Sim{drv: drv, cu: cu, hosts: map[uint64][]byte{}, capturing: map[transfer.Stream]struct{}{}}, nil
}

// NewStream creates a stream (a caller's stream in tests).
func (s *Sim) NewStream() transfer.Stream {
	st, err := s.drv.StreamCreate(cuda.StreamNonBlocking, 0)
	if err != nil {
		return 0
	}
	return transfer.Stream(st)
}

// SetCapturing marks a caller stream as capturing a graph (or not).
func (s *Sim) SetCapturing(id transfer.Stream, on bool) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if on {
		s.capturing[id] = struct{}{}
	} else {
		delete(s.capturing, id)
	}
	return nil
}

// Launch runs fn in stream order on stream id, like a kernel.
func (s *Sim) Launch(id transfer.Stream, fn func()) error {
	return s.drv.LaunchHostFunc(cuda.Stream(id), fn)
}

// Gate blocks stream id at this point until the returned func is called.
func (s *Sim) Gate(id transfer.Stream) (open func(), err error) {
	ch := make(chan struct{})
	var once sync.Once
	if err := s.Launch(id, func() { <-ch }); err != nil {
		return nil, err
	}
	return func() { once.Do(func() { close(ch) }) }, nil
}

// RecordEvent records e on stream id.
func (s *Sim) RecordEvent(e transfer.Event, id transfer.Stream) error {
	return s.drv.EventRecord(cuda.Event(e), cuda.Stream(id))
}

// StreamWaitEvent makes stream id wait for e's most recent record.
func (s *Sim) StreamWaitEvent(id transfer.Stream, e transfer.Event) error {
	return s.drv.StreamWaitEvent(cuda.Stream(id), cuda.Event(e), cuda.EventWaitDefault)
}

// StreamSynchronize blocks until stream id is idle.
func (s *Sim) StreamSynchronize(id transfer.Stream) error {
	return s.drv.StreamSynchronize(cuda.Stream(id))
}

// InjectError makes err the context's sticky error: every later call fails
// (a *cuda.Error's code, or CUDA_ERROR_ILLEGAL_ADDRESS for another error).
func (s *Sim) InjectError(err error) {
	code := cuda.ErrorIllegalAddress
	var ce *cuda.Error
	if errors.As(err, &ce) {
		code = ce.Code
	}
	s.drv.MakeSticky(code)
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
	p, err := s.drv.MemAlloc(n)
	if err != nil {
		return 0, fmt.Errorf("%w: MemAlloc of %d bytes: %w", ErrSim, n, err)
	}
	return uint64(p), nil
}

// MemFree unmaps a MemAlloc allocation.
func (s *Sim) MemFree(addr uint64) error {
	if err := s.drv.MemFree(cuda.DevicePtr(addr)); err != nil {
		return fmt.Errorf("%w: MemFree %#x: %w", ErrSim, addr, err)
	}
	return nil
}

// RegisterHost makes b addressable by the simulation at its real address,
// which it returns. b must stay valid until UnregisterHost.
func (s *Sim) RegisterHost(b []byte) (uint64, error) {
	if len(b) == 0 {
		return 0, fmt.Errorf("%w: RegisterHost of an empty buffer", ErrSim)
	}
	p := unsafe.Pointer(&b[0])
	if err := s.drv.MemHostRegister(p, uint64(len(b)), cuda.HostRegisterPortable|cuda.HostRegisterDeviceMap); err != nil {
		return 0, fmt.Errorf("%w: host %p+%d: %w", ErrSim, p, len(b), err)
	}
	addr := uint64(uintptr(p))
	s.mu.Lock()
	s.hosts[addr] = b
	s.mu.Unlock()
	return addr, nil
}

// UnregisterHost forgets a RegisterHost buffer.
func (s *Sim) UnregisterHost(addr uint64) error {
	s.mu.Lock()
	b, ok := s.hosts[addr]
	delete(s.hosts, addr)
	s.mu.Unlock()
	if !ok {
		return fmt.Errorf("%w: host %#x was not registered", ErrSim, addr)
	}
	return s.drv.MemHostUnregister(unsafe.Pointer(&b[0]))
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

// access runs f on the memory at [addr, addr+n). Callers order it with
// the streams' copies (their events, or the ops' completion).
func (s *Sim) access(addr, n uint64, f func([]byte)) error {
	if n == 0 {
		return nil
	}
	b, ok := s.drv.Bytes(addr, n)
	if !ok {
		return fmt.Errorf("%w: [%#x,%#x) is not inside simulated memory", ErrSim, addr, addr+n)
	}
	f(b)
	return nil
}

// InitThread implements Device.
func (s *Sim) InitThread() error { return s.cu.InitThread() }

// AddHostRange gives a registered range to the copy kernels (the
// Scheduler forwards its own AddHostRange here).
func (s *Sim) AddHostRange(base, size uint64) error { return s.cu.AddHostRange(base, size) }

// RemoveHostRange forgets a host range.
func (s *Sim) RemoveHostRange(base uint64) error { return s.cu.RemoveHostRange(base) }

// takeCopyFailure returns (and clears) the failure FailNextCopy set.
func (s *Sim) takeCopyFailure() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	err := s.failCp
	s.failCp = nil
	return err
}

// Copy implements Device.
func (s *Sim) Copy(dir transfer.Direction, segs []transfer.Segment) (func(), error) {
	if dir != transfer.Load && dir != transfer.Store {
		return nil, fmt.Errorf("%w: direction %d", ErrSim, int(dir))
	}
	if err := s.takeCopyFailure(); err != nil {
		return nil, err
	}
	return s.cu.Copy(dir, segs)
}

// Record implements Device.
func (s *Sim) Record(dir transfer.Direction, e transfer.Event) error { return s.cu.Record(dir, e) }

// Wait implements Device.
func (s *Sim) Wait(dir transfer.Direction, e transfer.Event) error { return s.cu.Wait(dir, e) }

// SyncStream implements Device.
func (s *Sim) SyncStream(dir transfer.Direction) error { return s.cu.SyncStream(dir) }

// CreateEvent implements Device.
func (s *Sim) CreateEvent(blockingSync bool) (transfer.Event, error) {
	return s.cu.CreateEvent(blockingSync)
}

// DestroyEvent implements Device.
func (s *Sim) DestroyEvent(e transfer.Event) error { return s.cu.DestroyEvent(e) }

// Query implements Device.
func (s *Sim) Query(e transfer.Event) (bool, error) { return s.cu.Query(e) }

// Sync implements Device.
func (s *Sim) Sync(e transfer.Event) error { return s.cu.Sync(e) }

// IsCapturing implements Device: a stream SetCapturing marked, or one
// capturing in the fake.
func (s *Sim) IsCapturing(id transfer.Stream) (bool, error) {
	s.mu.Lock()
	_, on := s.capturing[id]
	s.mu.Unlock()
	if on {
		return true, nil
	}
	return s.cu.IsCapturing(id)
}

// Close releases the engine streams, the copy kernels and the fake
// driver (its memory included). The scheduler is closed first. After a
// sticky error the context's objects go with it: Close does not report
// their release failing.
func (s *Sim) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	err := errors.Join(s.cu.Close(), s.drv.PrimaryCtxRelease(0))
	if cuda.IsSticky(err) {
		// A lost context (InjectError) frees everything with it.
		err = nil
	}
	return errors.Join(err, s.drv.Close())
}
