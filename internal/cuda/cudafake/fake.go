package cudafake

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

// Options configures a fake driver. The zero value is a usable single H200-like
// device with 1 GiB of device memory, the batch copy API and no delays.
type Options struct {
	// Seed seeds the per-item delays.
	Seed uint64
	// MaxDelay is the upper bound of the random delay added before every
	// queued work item runs (0: none).
	MaxDelay time.Duration
	// CopyMinDelay and CopyMaxDelay bound a random delay added before
	// each copy, kernel and host function only (on top of MaxDelay), so
	// that a simulation can hold copies without slowing its bookkeeping.
	CopyMinDelay, CopyMaxDelay time.Duration
	// DeviceMemory is the device capacity in bytes (0: 1 GiB).
	DeviceMemory uint64
	// NoMemcpyBatch makes HasMemcpyBatch report false (a driver older than 12.8).
	NoMemcpyBatch bool
	// SyncingFree makes MemFree wait until no stream has work queued, as
	// the driver's cuMemFree may (it can wait for the device to go idle).
	SyncingFree bool
	// BlockingFree, with SyncingFree, makes every other driver call wait
	// while a MemFree waits for the device to go idle, as the H200
	// machine's driver held a cuMemcpyAsync on another thread behind a
	// cuMemFree that waited for the device (a stream wait that only
	// that copy's thread could satisfy then never ended).
	BlockingFree bool
	// DriverVersion is reported by DriverVersion (0: 12080).
	DriverVersion int
	// Devices is the number of devices (0: 1).
	Devices int
	// Attributes overrides device attribute values.
	Attributes map[cuda.Attribute]int
	// CheckContext makes context-bound calls fail with
	// CUDA_ERROR_INVALID_CONTEXT unless the calling OS thread has a retained
	// primary context current.
	CheckContext bool
}

// Counts is what a fake driver holds live: allocations, registrations and
// created objects. A test that released everything sees the zero Counts.
type Counts struct {
	DeviceAllocs    int
	DeviceBytes     uint64
	HostAllocs      int
	HostAllocBytes  uint64
	Registrations   int
	RegisteredBytes uint64
	Streams         int // created with StreamCreate, not yet destroyed
	Events          int
	Modules         int
	Graphs          int
	GraphExecs      int
	PrimaryCtxRefs  int
}

// IsZero reports whether nothing is live.
func (c Counts) IsZero() bool { return c == Counts{} }

var defaultAttributes = map[cuda.Attribute]int{
	cuda.AttrMultiprocessorCount:               132,
	cuda.AttrPCIBusID:                          0x19,
	cuda.AttrPCIDeviceID:                       0,
	cuda.AttrPCIDomainID:                       0,
	cuda.AttrComputeCapabilityMajor:            9,
	cuda.AttrComputeCapabilityMinor:            0,
	cuda.AttrCanUseHostPointerForRegisteredMem: 1,
	cuda.AttrHostRegisterSupported:             1,
}

// Stream priorities reported by StreamPriorityRange (the H200's).
const (
	leastPriority    = 0
	greatestPriority = -5
)

type opCall struct {
	op string
	n  int
}

type callFlags uint8

const (
	needCtx callFlags = 1 << iota
	unsafeInCapture
)

// Driver is the fake driver. It is safe for concurrent use. Fault-injection
// settings may be changed at any time; they apply to calls made afterwards.
type Driver struct {
	opts Options

	mu         sync.Mutex
	cond       *sync.Cond
	closed     bool
	stickyCode cuda.Result
	hasBatch   bool
	calls      map[string]int
	failAt     map[opCall]cuda.Result
	stickyAt   map[opCall]cuda.Result
	hangAt     map[opCall]bool
	hook       func(op string, call int) cuda.Result
	rng        *rand.Rand
	nextHandle uintptr
	streams    map[cuda.Stream]*stream
	// running: every stream whose goroutine runs, destroyed ones still
	// draining included (what SyncingFree waits for).
	running    map[*stream]struct{}
	freeing    int // MemFrees waiting for the device (BlockingFree)
	events     map[cuda.Event]*event
	modules    map[cuda.Module]*module
	funcs      map[cuda.Function]*function
	graphs     map[cuda.Graph][]item
	execs      map[cuda.GraphExec][]item
	ctxRefs    []int
	threadMode map[int]cuda.CaptureMode
	current    map[int]cuda.Context
	wg         sync.WaitGroup

	mem memory
}

var _ cuda.Driver = (*Driver)(nil)

// New returns a fake driver with the legacy stream running. Call Close when
// done to stop its goroutines and unmap its memory.
func New(opts Options) *Driver {
	if opts.DeviceMemory == 0 {
		opts.DeviceMemory = 1 << 30
	}
	if opts.DriverVersion == 0 {
		opts.DriverVersion = 12080
	}
	if opts.Devices == 0 {
		opts.Devices = 1
	}
	d := &Driver{
		opts:       opts,
		hasBatch:   !opts.NoMemcpyBatch,
		calls:      map[string]int{},
		failAt:     map[opCall]cuda.Result{},
		stickyAt:   map[opCall]cuda.Result{},
		hangAt:     map[opCall]bool{},
		rng:        rand.New(rand.NewPCG(opts.Seed, opts.Seed^0x9E3779B97F4A7C15)),
		nextHandle: 0x1000,
		streams:    map[cuda.Stream]*stream{},
		running:    map[*stream]struct{}{},
		events:     map[cuda.Event]*event{},
		modules:    map[cuda.Module]*module{},
		funcs:      map[cuda.Function]*function{},
		graphs:     map[cuda.Graph][]item{},
		execs:      map[cuda.GraphExec][]item{},
		ctxRefs:    make([]int, opts.Devices),
		threadMode: map[int]cuda.CaptureMode{},
		current:    map[int]cuda.Context{},
	}
	d.cond = sync.NewCond(&d.mu)
	d.mem.capacity = opts.DeviceMemory
	d.startStreamLocked(0)
	return d
}

// FailAt makes the n-th call (1-based, counted per function) of op return
// code instead of running. A sticky code (cuda.Error.Sticky) also poisons
// the context, as MakeSticky does.
func (d *Driver) FailAt(op string, n int, code cuda.Result) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.failAt[opCall{op, n}] = code
}

// StickyAt makes the work enqueued by the n-th call of op (MemcpyAsync,
// Memcpy2DAsync, MemcpyBatchAsync, LaunchKernel, GraphLaunch, EventRecord*, StreamWaitEvent)
// fail when its stream reaches it: the call itself succeeds, and from then on
// every call returns code, as after a kernel fault.
func (d *Driver) StickyAt(op string, n int, code cuda.Result) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.stickyAt[opCall{op, n}] = code
}

// HangAt makes the event recorded by the n-th call of op (cuda.OpEventRecord
// or cuda.OpEventRecordWithFlags) never complete: EventQuery keeps reporting
// it pending and streams waiting on it stall, until it is recorded again or
// the driver is closed.
func (d *Driver) HangAt(op string, n int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.hangAt[opCall{op, n}] = true
}

// SetHook installs h, called for every driver call with the function name
// and its 1-based call index; a non-zero result fails the call with that
// code (sticky codes poison the context). h runs with the driver's lock held
// and must not call the driver. FailAt entries take precedence.
func (d *Driver) SetHook(h func(op string, call int) cuda.Result) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.hook = h
}

// MakeSticky poisons the context now: every later call returns code.
func (d *Driver) MakeSticky(code cuda.Result) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.stickyCode = code
	d.cond.Broadcast()
}

// SetMemcpyBatch sets what HasMemcpyBatch reports.
func (d *Driver) SetMemcpyBatch(ok bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.hasBatch = ok
}

// Calls returns how many times op has been called.
func (d *Driver) Calls(op string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.calls[op]
}

// PeakDeviceBytes is the most device memory (MemAlloc bytes) that has been
// allocated at once since New.
func (d *Driver) PeakDeviceBytes() uint64 { return d.mem.devicePeak() }

// Live counts what is currently allocated, registered and created.
func (d *Driver) Live() Counts {
	d.mu.Lock()
	c := Counts{
		Events:     len(d.events),
		Modules:    len(d.modules),
		Graphs:     len(d.graphs),
		GraphExecs: len(d.execs),
	}
	for h := range d.streams {
		if h != 0 {
			c.Streams++
		}
	}
	for _, r := range d.ctxRefs {
		c.PrimaryCtxRefs += r
	}
	d.mu.Unlock()
	d.mem.count(&c)
	return c
}

// Close stops every stream goroutine (abandoning queued work and waking
// anything blocked in a synchronize call, which then returns
// CUDA_ERROR_DEINITIALIZED) and unmaps all memory the fake allocated. Later
// calls fail with CUDA_ERROR_DEINITIALIZED. Closing twice returns an error.
func (d *Driver) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return fmt.Errorf("cudafake: driver already closed")
	}
	d.closed = true
	d.cond.Broadcast()
	d.mu.Unlock()
	d.wg.Wait()
	return d.mem.releaseAll()
}

// beginLocked accounts a call of op and decides whether it may run.
func (d *Driver) beginLocked(op string, fl callFlags) (int, error) {
	for d.freeing > 0 && !d.closed && d.stickyCode == cuda.Success {
		d.cond.Wait()
	}
	if d.closed {
		return 0, cuda.NewError(op, cuda.ErrorDeinitialized)
	}
	d.calls[op]++
	n := d.calls[op]
	if d.stickyCode != cuda.Success {
		return n, cuda.NewError(op, d.stickyCode)
	}
	code := d.failAt[opCall{op, n}]
	if code == cuda.Success && d.hook != nil {
		code = d.hook(op, n)
	}
	if code != cuda.Success {
		e := cuda.NewError(op, code)
		if e.Sticky() {
			d.stickyCode = code
			d.cond.Broadcast()
		}
		return n, e
	}
	if fl&needCtx != 0 && d.opts.CheckContext {
		ctx := d.current[unix.Gettid()]
		if dev := int(ctx) - ctxBase; ctx == 0 || dev < 0 || dev >= len(d.ctxRefs) || d.ctxRefs[dev] == 0 {
			return n, cuda.NewError(op, cuda.ErrorInvalidContext)
		}
	}
	if fl&unsafeInCapture != 0 {
		if err := d.checkCaptureLocked(op); err != nil {
			return n, err
		}
	}
	return n, nil
}

func (d *Driver) begin(op string, fl callFlags) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	_, err := d.beginLocked(op, fl)
	return err
}

// checkCaptureLocked applies CUDA's rule for potentially unsafe calls made
// while a capture is in progress.
func (d *Driver) checkCaptureLocked(op string) error {
	tid := unix.Gettid()
	mode := d.threadMode[tid]
	if mode == cuda.CaptureModeRelaxed {
		return nil
	}
	var hit bool
	for _, s := range d.streams {
		c := s.capture
		if c == nil || c.mode == cuda.CaptureModeRelaxed {
			continue
		}
		if c.tid == tid || (mode == cuda.CaptureModeGlobal && c.mode == cuda.CaptureModeGlobal) {
			c.invalidated = true
			hit = true
		}
	}
	if hit {
		return cuda.NewError(op, cuda.ErrorStreamCaptureUnsupported)
	}
	return nil
}

func (d *Driver) handleLocked() uintptr {
	d.nextHandle++
	return d.nextHandle
}

func (d *Driver) delayLocked() time.Duration {
	if d.opts.MaxDelay <= 0 {
		return 0
	}
	return time.Duration(d.rng.Int64N(int64(d.opts.MaxDelay) + 1))
}

// copyDelayLocked is the extra delay of a copy, kernel or host function.
func (d *Driver) copyDelayLocked(it *item) time.Duration {
	if d.opts.CopyMaxDelay <= 0 || (it.kind != itemCopy && it.kind != itemBatch && it.kind != itemKernel && it.kind != itemHost) {
		return 0
	}
	return d.opts.CopyMinDelay + time.Duration(d.rng.Int64N(int64(d.opts.CopyMaxDelay-d.opts.CopyMinDelay)+1))
}

// ctxBase offsets primary context handles so that no device's is zero.
const ctxBase = 0x100

// DriverVersion implements cuda.Driver.
func (d *Driver) DriverVersion() (int, error) {
	if err := d.begin(cuda.OpDriverVersion, 0); err != nil {
		return 0, err
	}
	return d.opts.DriverVersion, nil
}

// DeviceCount implements cuda.Driver.
func (d *Driver) DeviceCount() (int, error) {
	if err := d.begin(cuda.OpDeviceCount, 0); err != nil {
		return 0, err
	}
	return d.opts.Devices, nil
}

func (d *Driver) checkDevice(op string, dev cuda.Device) error {
	if int(dev) < 0 || int(dev) >= d.opts.Devices {
		return cuda.NewError(op, cuda.ErrorInvalidDevice)
	}
	return nil
}

// DeviceGet implements cuda.Driver.
func (d *Driver) DeviceGet(ordinal int) (cuda.Device, error) {
	if err := d.begin(cuda.OpDeviceGet, 0); err != nil {
		return 0, err
	}
	if err := d.checkDevice(cuda.OpDeviceGet, cuda.Device(ordinal)); err != nil {
		return 0, err
	}
	return cuda.Device(ordinal), nil
}

// DeviceName implements cuda.Driver.
func (d *Driver) DeviceName(dev cuda.Device) (string, error) {
	if err := d.begin(cuda.OpDeviceName, 0); err != nil {
		return "", err
	}
	if err := d.checkDevice(cuda.OpDeviceName, dev); err != nil {
		return "", err
	}
	return "cudafake simulated device", nil
}

func (d *Driver) attribute(attr cuda.Attribute) (int, bool) {
	if v, ok := d.opts.Attributes[attr]; ok {
		return v, true
	}
	v, ok := defaultAttributes[attr]
	return v, ok
}

// DeviceAttribute implements cuda.Driver. Attributes the fake does not know
// return CUDA_ERROR_INVALID_VALUE unless set in Options.Attributes.
func (d *Driver) DeviceAttribute(attr cuda.Attribute, dev cuda.Device) (int, error) {
	if err := d.begin(cuda.OpDeviceAttribute, 0); err != nil {
		return 0, err
	}
	if err := d.checkDevice(cuda.OpDeviceAttribute, dev); err != nil {
		return 0, err
	}
	v, ok := d.attribute(attr)
	if !ok {
		return 0, cuda.NewError(cuda.OpDeviceAttribute, cuda.ErrorInvalidValue)
	}
	return v, nil
}

// DevicePCIBusID implements cuda.Driver.
func (d *Driver) DevicePCIBusID(dev cuda.Device) (string, error) {
	if err := d.begin(cuda.OpDevicePCIBusID, 0); err != nil {
		return "", err
	}
	if err := d.checkDevice(cuda.OpDevicePCIBusID, dev); err != nil {
		return "", err
	}
	dom, _ := d.attribute(cuda.AttrPCIDomainID)
	bus, _ := d.attribute(cuda.AttrPCIBusID)
	pdev, _ := d.attribute(cuda.AttrPCIDeviceID)
	return fmt.Sprintf("%04x:%02x:%02x.0", dom, bus+int(dev), pdev), nil
}

// DeviceTotalMem implements cuda.Driver.
func (d *Driver) DeviceTotalMem(dev cuda.Device) (uint64, error) {
	if err := d.begin(cuda.OpDeviceTotalMem, 0); err != nil {
		return 0, err
	}
	if err := d.checkDevice(cuda.OpDeviceTotalMem, dev); err != nil {
		return 0, err
	}
	return d.opts.DeviceMemory, nil
}

// MemGetInfo implements cuda.Driver.
func (d *Driver) MemGetInfo() (free, total uint64, err error) {
	if err := d.begin(cuda.OpMemGetInfo, needCtx); err != nil {
		return 0, 0, err
	}
	used := d.mem.deviceUsed()
	return d.opts.DeviceMemory - used, d.opts.DeviceMemory, nil
}

// PrimaryCtxRetain implements cuda.Driver.
func (d *Driver) PrimaryCtxRetain(dev cuda.Device) (cuda.Context, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(cuda.OpPrimaryCtxRetain, 0); err != nil {
		return 0, err
	}
	if err := d.checkDevice(cuda.OpPrimaryCtxRetain, dev); err != nil {
		return 0, err
	}
	d.ctxRefs[dev]++
	return cuda.Context(ctxBase + int(dev)), nil
}

// PrimaryCtxRelease implements cuda.Driver.
func (d *Driver) PrimaryCtxRelease(dev cuda.Device) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(cuda.OpPrimaryCtxRelease, 0); err != nil {
		return err
	}
	if err := d.checkDevice(cuda.OpPrimaryCtxRelease, dev); err != nil {
		return err
	}
	if d.ctxRefs[dev] == 0 {
		return cuda.NewError(cuda.OpPrimaryCtxRelease, cuda.ErrorInvalidContext)
	}
	d.ctxRefs[dev]--
	return nil
}

// CtxSetCurrent implements cuda.Driver: it binds ctx to the calling OS thread.
func (d *Driver) CtxSetCurrent(ctx cuda.Context) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(cuda.OpCtxSetCurrent, 0); err != nil {
		return err
	}
	tid := unix.Gettid()
	if ctx == 0 {
		delete(d.current, tid)
		return nil
	}
	if dev := int(ctx) - ctxBase; dev < 0 || dev >= len(d.ctxRefs) || d.ctxRefs[dev] == 0 {
		return cuda.NewError(cuda.OpCtxSetCurrent, cuda.ErrorInvalidContext)
	}
	d.current[tid] = ctx
	return nil
}

// CtxGetCurrent implements cuda.Driver: the context bound to the calling OS
// thread, 0 when none is.
func (d *Driver) CtxGetCurrent() (cuda.Context, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(cuda.OpCtxGetCurrent, 0); err != nil {
		return 0, err
	}
	return d.current[unix.Gettid()], nil
}

// CtxSynchronize implements cuda.Driver: it waits for the work queued on
// every stream at the time of the call.
func (d *Driver) CtxSynchronize() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(cuda.OpCtxSynchronize, needCtx|unsafeInCapture); err != nil {
		return err
	}
	targets := map[*stream]uint64{}
	for _, s := range d.streams {
		targets[s] = s.enq
	}
	for s, t := range targets {
		if err := d.waitStreamLocked(cuda.OpCtxSynchronize, s, t); err != nil {
			return err
		}
	}
	return nil
}

// StreamPriorityRange implements cuda.Driver.
func (d *Driver) StreamPriorityRange() (least, greatest int, err error) {
	if err := d.begin(cuda.OpStreamPriorityRange, needCtx); err != nil {
		return 0, 0, err
	}
	return leastPriority, greatestPriority, nil
}

// ThreadExchangeStreamCaptureMode implements cuda.Driver for the calling OS
// thread.
func (d *Driver) ThreadExchangeStreamCaptureMode(mode cuda.CaptureMode) (cuda.CaptureMode, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(cuda.OpThreadExchangeStreamCaptureMode, 0); err != nil {
		return 0, err
	}
	if mode > cuda.CaptureModeRelaxed {
		return 0, cuda.NewError(cuda.OpThreadExchangeStreamCaptureMode, cuda.ErrorInvalidValue)
	}
	tid := unix.Gettid()
	prev := d.threadMode[tid]
	d.threadMode[tid] = mode
	return prev, nil
}
