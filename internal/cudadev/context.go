package cudadev

import (
	"errors"
	"fmt"
	"sync"
	"time"
	"unsafe"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
	"github.com/kvoffload/kvoffload/transfer"
)

// ErrNoDriver: libcuda.so.1 (or a device) is not available, or the module
// was built with CGO_ENABLED=0.
var ErrNoDriver = cuda.ErrNoDriver

// DefaultMaxDeviceBytes is the bound on the copy layer's device memory
// when CUDAOptions.MaxDeviceBytes is 0.
const DefaultMaxDeviceBytes = cudacopy.DefaultMaxDeviceBytes

// MinDeviceBytes is the smallest CUDAOptions.MaxDeviceBytes the copy layer
// can work in: one descriptor table and one device chunk.
func MinDeviceBytes() int64 { return cudacopy.MinDeviceBytes(cudacopy.Options{}) }

// SysfsBusID turns a CUDA or nvidia-smi PCI bus id ("00000000:19:00.0")
// into the device's name under /sys/bus/pci/devices ("0000:19:00.0").
func SysfsBusID(id string) string { return cuda.SysfsBusID(id) }

// IsContextLost reports whether err is a sticky driver error: the context
// is unusable, and its streams and module went with it.
func IsContextLost(err error) bool { return cuda.IsSticky(err) }

// Driver is the CUDA driver, loaded at run time (dlopen of libcuda.so.1,
// never linked).
type Driver struct{ drv cuda.Driver }

// WrapDriver returns drv as a Driver (tests: the fake driver of
// internal/cuda/cudafake, or a wrapper of it).
func WrapDriver(drv cuda.Driver) *Driver { return &Driver{drv: drv} }

// LoadDriver loads and initialises the driver; the error wraps ErrNoDriver
// when the library, a required symbol or cuInit fails, or the build has no
// cgo.
func LoadDriver() (*Driver, error) {
	drv, err := cuda.Load()
	if err != nil {
		return nil, err
	}
	return &Driver{drv: drv}, nil
}

// Probe checks that device exists and returns its PCI bus id as the driver
// gives it. Errors wrap ErrNoDriver and name the device.
func (d *Driver) Probe(device int) (busID string, err error) {
	n, err := d.drv.DeviceCount()
	switch {
	case err != nil:
		return "", fmt.Errorf("%w: counting devices: %w", ErrNoDriver, err)
	case device >= n:
		return "", fmt.Errorf("%w: device %d asked for, the driver sees %d device(s)", ErrNoDriver, device, n)
	}
	dev, err := d.drv.DeviceGet(device)
	if err == nil {
		busID, err = d.drv.DevicePCIBusID(dev)
	}
	if err != nil {
		return "", fmt.Errorf("%w: device %d: %w", ErrNoDriver, device, err)
	}
	return busID, nil
}

// Open retains device's primary context (the one a serving stack's CUDA
// runtime already uses). Release it with Context.Release.
func (d *Driver) Open(device int) (*Context, error) {
	dev, err := d.drv.DeviceGet(device)
	if err != nil {
		return nil, fmt.Errorf("%w: device %d: %w", ErrNoDriver, device, err)
	}
	ctx, err := d.drv.PrimaryCtxRetain(dev)
	if err != nil {
		return nil, fmt.Errorf("%w: retaining device %d's primary context: %w", ErrNoDriver, device, err)
	}
	return &Context{drv: d.drv, dev: dev, ctx: ctx, ordinal: device, held: true}, nil
}

// Bind wraps ctx, a context of drv's that the caller holds, as a Context
// (tests and benchmarks that drive the driver themselves); its Release does
// nothing and its Device is 0.
func Bind(drv cuda.Driver, ctx cuda.Context) *Context {
	return &Context{drv: drv, ctx: ctx}
}

// Context is one device's retained primary context: what the copy layer's
// streams, events and device memory live in, and what register pins host
// memory for. Its methods that call the driver say on which thread.
type Context struct {
	drv     cuda.Driver
	dev     cuda.Device
	ctx     cuda.Context
	ordinal int
	mu      sync.Mutex
	held    bool
}

// Device is the device ordinal the context was opened on.
func (c *Context) Device() int { return c.ordinal }

// Do runs f on the calling goroutine's OS thread, locked, with the context
// current and the stream capture mode relaxed; the thread's previous
// context (none included) and capture mode are restored afterwards, so a
// caller's thread (an application's, through the C ABI) keeps its CUDA
// runtime device.
func (c *Context) Do(f func() error) error { return cuda.OnThread(c.drv, c.ctx, f) }

// InitThread prepares the calling goroutine's OS thread, which the caller
// has locked and keeps, for driver calls: the context current and capture
// mode relaxed, neither restored (an engine thread's).
func (c *Context) InitThread() error {
	if err := c.drv.CtxSetCurrent(c.ctx); err != nil {
		return fmt.Errorf("make context current: %w", err)
	}
	if _, err := c.drv.ThreadExchangeStreamCaptureMode(cuda.CaptureModeRelaxed); err != nil {
		return fmt.Errorf("relax capture mode: %w", err)
	}
	return nil
}

// AllocationRange returns the device allocation that holds addr
// (cuMemGetAddressRange): its base and size. The calling thread must have
// the context current (Do).
func (c *Context) AllocationRange(addr uint64) (base, size uint64, err error) {
	b, n, err := c.drv.MemGetAddressRange(cuda.DevicePtr(addr))
	return uint64(b), n, err
}

// HostDevicePointer returns the device address of registered host memory
// at p (cuMemHostGetDevicePointer), on the calling thread (Do inside).
func (c *Context) HostDevicePointer(p unsafe.Pointer) (uint64, error) {
	var d cuda.DevicePtr
	err := c.Do(func() error {
		var err error
		d, err = c.drv.MemHostGetDevicePointer(p)
		return err
	})
	return uint64(d), err
}

// hostRegisterFlags are the flags every host registration uses: portable
// to all contexts, and mapped into the device address space (harmless with
// unified addressing, and what MemHostGetDevicePointer relies on).
const hostRegisterFlags = cuda.HostRegisterPortable | cuda.HostRegisterDeviceMap

// HostRegister pins [p, p+n) with hostRegisterFlags
// (cuMemHostRegister_v2), on a thread Do prepared: register.Context.
func (c *Context) HostRegister(p unsafe.Pointer, n uint64) error {
	return c.drv.MemHostRegister(p, n, hostRegisterFlags)
}

// HostUnregister unpins the registration at p (cuMemHostUnregister), on a
// thread Do prepared: register.Context.
func (c *Context) HostUnregister(p unsafe.Pointer) error { return c.drv.MemHostUnregister(p) }

// StreamWaitEvent makes a caller's stream s wait for the most recent
// record of e (cuStreamWaitEvent); it takes no context.
func (c *Context) StreamWaitEvent(s transfer.Stream, e transfer.Event) error {
	return c.drv.StreamWaitEvent(cuda.Stream(s), cuda.Event(e), cuda.EventWaitDefault)
}

// Release drops the primary context reference Open took; later calls do
// nothing. A driver gone meanwhile (ErrNoDriver) is not an error.
func (c *Context) Release() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.held {
		return nil
	}
	c.held = false
	if err := c.drv.PrimaryCtxRelease(c.dev); err != nil && !errors.Is(err, ErrNoDriver) {
		return fmt.Errorf("releasing device %d's primary context: %w", c.ordinal, err)
	}
	return nil
}

// CopyOptions tune the copy method (internal/cudacopy): tests and
// benchmarks force a method or shrink its buffers through them.
type CopyOptions = cudacopy.Options

// CUDAOptions configure the CUDA device (NewCUDA).
type CUDAOptions struct {
	// MaxDeviceBytes bounds the copy layer's device memory (descriptor
	// tables, device chunks, the calibration buffer); 0: Copy's bound, or
	// DefaultMaxDeviceBytes.
	MaxDeviceBytes int64
	// GreedyStores launches the store kernel unthrottled (no read-back
	// every few KiB): faster stores, at the cost of the model's kernels.
	GreedyStores bool
	// CalibrateLater starts the automatic choice of copy method with its
	// uncalibrated rule, for CUDA.Calibrate to measure later (when the
	// CPUs are free), instead of calibrating in NewCUDA. No effect when
	// Copy forces a method or gives a calibration.
	CalibrateLater bool
	// Copy tunes the copy method further; the fields above take precedence.
	Copy CopyOptions
}

// NewCUDA creates the engine's streams and copier in c (see the CUDA
// type), on the calling thread with the context made current for the call.
func (c *Context) NewCUDA(opts CUDAOptions) (*CUDA, error) {
	co := opts.Copy
	co.GreedyD2H = co.GreedyD2H || opts.GreedyStores
	if opts.MaxDeviceBytes != 0 {
		co.MaxDeviceBytes = opts.MaxDeviceBytes
	}
	later := false
	if opts.CalibrateLater && co.Method == cudacopy.MethodAuto && co.Calibration == nil {
		co.Calibration = &cudacopy.Calibration{}
		later = true
	}
	var dev *CUDA
	err := c.Do(func() error {
		var err error
		dev, err = newCUDA(c.drv, c.dev, c.ctx, co)
		if err == nil && !later {
			dev.warmStaging()
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	dev.calibrateLater = later
	return dev, nil
}

// CalibrationPending reports whether NewCUDA left the calibration to
// Calibrate (CUDAOptions.CalibrateLater) and it has not run yet.
func (c *CUDA) CalibrationPending() bool { return c.calibrateLater }

// Calibrate measures the copy methods on a stream of its own and installs
// the table the copier chooses from, once: later calls do nothing. The
// calling thread must have the context current. On error the uncalibrated
// rule stays. It returns how long the measurement took. Then, its buffer
// freed, it fills the copier's staging share (warmStaging).
func (c *CUDA) Calibrate() (time.Duration, error) {
	if !c.calibrateLater {
		return 0, nil
	}
	c.calibrateLater = false
	t0 := time.Now()
	s, err := c.drv.StreamCreate(cuda.StreamNonBlocking, 0)
	if err == nil {
		_, err = c.copier.Calibrate(s)
		err = errors.Join(err, c.drv.StreamDestroy(s))
	}
	took := time.Since(t0)
	c.warmStaging()
	return took, err
}
