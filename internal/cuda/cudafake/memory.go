package cudafake

import (
	"errors"
	"fmt"
	"sort"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

type spanKind uint8

const (
	spanDevice     spanKind = iota // MemAlloc
	spanHostAlloc                  // MemHostAlloc
	spanRegistered                 // MemHostRegister
)

// span is one known range of addresses: a fake allocation (mapping holds the
// whole mmap for Munmap) or a caller's registered range.
type span struct {
	base    uint64
	mem     []byte
	mapping []byte
	kind    spanKind
}

func (s *span) end() uint64 { return s.base + uint64(len(s.mem)) }

// memory is the fake's address space. Copies hold mu for reading while they
// touch memory, so nothing is unmapped under a copy; allocation, free,
// registration and unregistration hold it for writing.
type memory struct {
	mu       sync.RWMutex
	spans    []*span // sorted by base, non-overlapping
	capacity uint64
	used     uint64
	peak     uint64 // the most used has been (PeakDeviceBytes)
}

// find returns the index of the span containing addr, or -1.
func (m *memory) find(addr uint64) int {
	i := sort.Search(len(m.spans), func(i int) bool { return m.spans[i].base > addr }) - 1
	if i >= 0 && addr < m.spans[i].end() {
		return i
	}
	return -1
}

// slice returns the n bytes at addr when they lie within one known span.
// The caller holds mu.
func (m *memory) slice(addr, n uint64) ([]byte, bool) {
	if n == 0 {
		return nil, true
	}
	if addr+n < addr {
		return nil, false
	}
	i := m.find(addr)
	if i < 0 || addr+n > m.spans[i].end() {
		return nil, false
	}
	s := m.spans[i]
	off := addr - s.base
	return s.mem[off : off+n], true
}

// valid reports whether [addr, addr+n) lies within one known span.
func (m *memory) valid(addr, n uint64) bool {
	m.mu.RLock()
	defer m.mu.RUnlock()
	_, ok := m.slice(addr, n)
	return ok
}

func (m *memory) insert(s *span) {
	i := sort.Search(len(m.spans), func(i int) bool { return m.spans[i].base > s.base })
	m.spans = append(m.spans, nil)
	copy(m.spans[i+1:], m.spans[i:])
	m.spans[i] = s
}

func (m *memory) remove(i int) {
	m.spans = append(m.spans[:i], m.spans[i+1:]...)
}

// overlaps reports whether [base, base+n) intersects a known span.
func (m *memory) overlaps(base, n uint64) bool {
	i := sort.Search(len(m.spans), func(i int) bool { return m.spans[i].base >= base+n })
	return i > 0 && m.spans[i-1].end() > base
}

func (m *memory) mmap(op string, size uint64, kind spanKind) (*span, error) {
	if size == 0 || size > 1<<46 {
		return nil, cuda.NewError(op, cuda.ErrorInvalidValue)
	}
	page := uint64(unix.Getpagesize())
	mapping, err := unix.Mmap(-1, 0, int((size+page-1)/page*page),
		unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return nil, cuda.NewError(op, cuda.ErrorOutOfMemory)
	}
	return &span{
		base:    uint64(uintptr(unsafe.Pointer(&mapping[0]))),
		mem:     mapping[:size],
		mapping: mapping,
		kind:    kind,
	}, nil
}

func (m *memory) alloc(op string, size uint64, kind spanKind) (*span, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if kind == spanDevice && (size > m.capacity || m.used > m.capacity-size) {
		return nil, cuda.NewError(op, cuda.ErrorOutOfMemory)
	}
	s, err := m.mmap(op, size, kind)
	if err != nil {
		return nil, err
	}
	m.insert(s)
	if kind == spanDevice {
		m.used += size
		m.peak = max(m.peak, m.used)
	}
	return s, nil
}

// free unmaps the allocation of this kind that starts at base.
func (m *memory) free(op string, base uint64, kind spanKind) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	i := m.find(base)
	if i < 0 || m.spans[i].base != base || m.spans[i].kind != kind {
		return cuda.NewError(op, cuda.ErrorInvalidValue)
	}
	s := m.spans[i]
	if err := unix.Munmap(s.mapping); err != nil {
		return cuda.NewError(op, cuda.ErrorUnknown)
	}
	m.remove(i)
	if kind == spanDevice {
		m.used -= uint64(len(s.mem))
	}
	return nil
}

func (m *memory) register(op string, p unsafe.Pointer, size uint64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	base := uint64(uintptr(p))
	if p == nil || size == 0 || base+size < base {
		return cuda.NewError(op, cuda.ErrorInvalidValue)
	}
	if m.overlaps(base, size) {
		return cuda.NewError(op, cuda.ErrorHostMemoryAlreadyRegistered)
	}
	m.insert(&span{base: base, mem: unsafe.Slice((*byte)(p), size), kind: spanRegistered})
	return nil
}

func (m *memory) unregister(op string, p unsafe.Pointer) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	base := uint64(uintptr(p))
	i := m.find(base)
	if i < 0 || m.spans[i].base != base || m.spans[i].kind != spanRegistered {
		return cuda.NewError(op, cuda.ErrorHostMemoryNotRegistered)
	}
	m.remove(i)
	return nil
}

// deviceRange returns the device allocation (MemAlloc) containing addr.
func (m *memory) deviceRange(addr uint64) (base, size uint64, ok bool) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	i := m.find(addr)
	if i < 0 || m.spans[i].kind != spanDevice {
		return 0, 0, false
	}
	return m.spans[i].base, uint64(len(m.spans[i].mem)), true
}

// hostPointer checks that p lies in registered or host-allocated memory.
func (m *memory) hostPointer(p unsafe.Pointer) bool {
	m.mu.RLock()
	defer m.mu.RUnlock()
	i := m.find(uint64(uintptr(p)))
	return i >= 0 && m.spans[i].kind != spanDevice
}

func (m *memory) deviceUsed() uint64 {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return m.used
}

func (m *memory) devicePeak() uint64 {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return m.peak
}

func (m *memory) count(c *Counts) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	for _, s := range m.spans {
		n := uint64(len(s.mem))
		switch s.kind {
		case spanDevice:
			c.DeviceAllocs++
			c.DeviceBytes += n
		case spanHostAlloc:
			c.HostAllocs++
			c.HostAllocBytes += n
		case spanRegistered:
			c.Registrations++
			c.RegisteredBytes += n
		}
	}
}

func (m *memory) releaseAll() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	var errs []error
	for _, s := range m.spans {
		if s.mapping != nil {
			if err := unix.Munmap(s.mapping); err != nil {
				errs = append(errs, fmt.Errorf("cudafake: munmap %#x: %w", s.base, err))
			}
		}
	}
	m.spans = nil
	m.used = 0
	return errors.Join(errs...)
}

// copyBytes copies n bytes from src to dst within known memory; false when
// either range is not (or no longer) known.
func (m *memory) copyBytes(dst, src, n uint64) bool {
	m.mu.RLock()
	defer m.mu.RUnlock()
	d, ok1 := m.slice(dst, n)
	s, ok2 := m.slice(src, n)
	if !ok1 || !ok2 {
		return false
	}
	copy(d, s)
	return true
}

// MemHostRegister implements cuda.Driver. Overlapping an existing
// registration or fake allocation fails with
// CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED.
func (d *Driver) MemHostRegister(p unsafe.Pointer, size uint64, flags uint32) error {
	if err := d.begin(cuda.OpMemHostRegister, needCtx|unsafeInCapture); err != nil {
		return err
	}
	if flags&^(cuda.HostRegisterPortable|cuda.HostRegisterDeviceMap|cuda.HostRegisterIOMemory|cuda.HostRegisterReadOnly) != 0 {
		return cuda.NewError(cuda.OpMemHostRegister, cuda.ErrorInvalidValue)
	}
	return d.mem.register(cuda.OpMemHostRegister, p, size)
}

// MemHostUnregister implements cuda.Driver: p must be the start of a
// registration.
func (d *Driver) MemHostUnregister(p unsafe.Pointer) error {
	if err := d.begin(cuda.OpMemHostUnregister, needCtx|unsafeInCapture); err != nil {
		return err
	}
	return d.mem.unregister(cuda.OpMemHostUnregister, p)
}

// MemHostGetDevicePointer implements cuda.Driver: with unified addressing the
// device pointer of registered or host-allocated memory is its host address.
func (d *Driver) MemHostGetDevicePointer(p unsafe.Pointer) (cuda.DevicePtr, error) {
	if err := d.begin(cuda.OpMemHostGetDevicePointer, needCtx); err != nil {
		return 0, err
	}
	if !d.mem.hostPointer(p) {
		return 0, cuda.NewError(cuda.OpMemHostGetDevicePointer, cuda.ErrorInvalidValue)
	}
	return cuda.DevicePtr(uintptr(p)), nil
}

// MemHostAlloc implements cuda.Driver with an mmap.
func (d *Driver) MemHostAlloc(size uint64, flags uint32) (unsafe.Pointer, error) {
	if err := d.begin(cuda.OpMemHostAlloc, needCtx|unsafeInCapture); err != nil {
		return nil, err
	}
	if flags&^(cuda.HostAllocPortable|cuda.HostAllocDeviceMap|cuda.HostAllocWriteCombined) != 0 {
		return nil, cuda.NewError(cuda.OpMemHostAlloc, cuda.ErrorInvalidValue)
	}
	s, err := d.mem.alloc(cuda.OpMemHostAlloc, size, spanHostAlloc)
	if err != nil {
		return nil, err
	}
	return unsafe.Pointer(&s.mem[0]), nil
}

// MemFreeHost implements cuda.Driver.
func (d *Driver) MemFreeHost(p unsafe.Pointer) error {
	if err := d.begin(cuda.OpMemFreeHost, needCtx|unsafeInCapture); err != nil {
		return err
	}
	return d.mem.free(cuda.OpMemFreeHost, uint64(uintptr(p)), spanHostAlloc)
}

// MemAlloc implements cuda.Driver: host memory from mmap, counted against
// Options.DeviceMemory.
func (d *Driver) MemAlloc(size uint64) (cuda.DevicePtr, error) {
	if err := d.begin(cuda.OpMemAlloc, needCtx|unsafeInCapture); err != nil {
		return 0, err
	}
	s, err := d.mem.alloc(cuda.OpMemAlloc, size, spanDevice)
	if err != nil {
		return 0, err
	}
	return cuda.DevicePtr(s.base), nil
}

// MemFree implements cuda.Driver.
func (d *Driver) MemFree(p cuda.DevicePtr) error {
	if err := d.begin(cuda.OpMemFree, needCtx|unsafeInCapture); err != nil {
		return err
	}
	if d.opts.SyncingFree {
		d.mu.Lock()
		if d.opts.BlockingFree {
			d.freeing++
		}
		for d.busyLocked() && !d.closed && d.stickyCode == cuda.Success {
			d.cond.Wait()
		}
		if d.opts.BlockingFree {
			d.freeing--
			d.cond.Broadcast()
		}
		d.mu.Unlock()
	}
	return d.mem.free(cuda.OpMemFree, uint64(p), spanDevice)
}

// busyLocked reports whether any stream, a destroyed one still draining
// included, has work queued.
func (d *Driver) busyLocked() bool {
	for s := range d.running {
		if len(s.queue) > 0 {
			return true
		}
	}
	return false
}

// MemGetAddressRange implements cuda.Driver: the MemAlloc allocation
// containing p (its requested size, not the page-rounded mapping);
// CUDA_ERROR_NOT_FOUND for any other address, host memory included.
func (d *Driver) MemGetAddressRange(p cuda.DevicePtr) (cuda.DevicePtr, uint64, error) {
	if err := d.begin(cuda.OpMemGetAddressRange, needCtx); err != nil {
		return 0, 0, err
	}
	base, size, ok := d.mem.deviceRange(uint64(p))
	if !ok {
		return 0, 0, cuda.NewError(cuda.OpMemGetAddressRange, cuda.ErrorNotFound)
	}
	return cuda.DevicePtr(base), size, nil
}

// MemsetD8 implements cuda.Driver, at once.
func (d *Driver) MemsetD8(dst cuda.DevicePtr, value uint8, n uint64) error {
	if err := d.begin(cuda.OpMemsetD8, needCtx|unsafeInCapture); err != nil {
		return err
	}
	d.mem.mu.RLock()
	defer d.mem.mu.RUnlock()
	b, ok := d.mem.slice(uint64(dst), n)
	if !ok {
		return cuda.NewError(cuda.OpMemsetD8, cuda.ErrorInvalidValue)
	}
	for i := range b {
		b[i] = value
	}
	return nil
}

// Memcpy implements cuda.Driver, at once.
func (d *Driver) Memcpy(dst, src cuda.DevicePtr, n uint64) error {
	if err := d.begin(cuda.OpMemcpy, needCtx|unsafeInCapture); err != nil {
		return err
	}
	if !d.mem.copyBytes(uint64(dst), uint64(src), n) {
		return cuda.NewError(cuda.OpMemcpy, cuda.ErrorInvalidValue)
	}
	return nil
}
