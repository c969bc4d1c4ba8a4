package cudacopy

// The Copier itself: Capabilities, Ticket and the ticket records, the
// descriptor buffers, the Copier struct with its state, New (loading the
// PTX module and allocating the first descriptor buffers), the accessors,
// the calibration Choose uses, and Close. Locks: Copier.mu, taken by
// Calibration, SetCalibration and Close (release runs under it from Close);
// newDescBuf runs with it held, or from New before the Copier is shared.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

// Capabilities says what a Copier found on its device.
type Capabilities struct {
	// Batch: cuMemcpyBatchAsync is bound (driver ≥ 12.8).
	Batch bool `json:"batch"`
	// Kernel: the PTX module loaded; KernelError says why not otherwise.
	Kernel      bool   `json:"kernel"`
	KernelError string `json:"kernel_error,omitempty"`
	// Kernel2D: the PTX image's copy kernels take 2-D descriptors (it has
	// Desc2DKernel), so Submit2D sends strided segments as they are;
	// otherwise one descriptor per row.
	Kernel2D bool `json:"kernel_2d"`
	// Template: the PTX image has the template launches' kernels
	// (TemplateKernel, TemplateProbeKernel), so NewTemplate and
	// SubmitTemplate work where the direction's copy kernel is the
	// default one (see NewTemplate).
	Template bool `json:"template"`
	// HostPointerIdentity: CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 1, so
	// the kernel uses registered host pointers as they are.
	HostPointerIdentity bool `json:"host_pointer_identity"`
	SMs                 int  `json:"sms"`
	// D2H and H2D are the copy kernel's launch per direction (D2D copies,
	// fills and checksums launch like H2D).
	D2H Launch `json:"d2h"`
	H2D Launch `json:"h2d"`
	// Staged is the launch of the device-side kernel of staged copies
	// (see Options.StagedCTAs).
	Staged Launch `json:"staged"`
}

// Ticket identifies the descriptor buffers of one Submit (or Fill or
// Checksum) until Retire. The zero Ticket holds nothing (the memcpy and
// batch methods), and retiring it is a no-op.
type Ticket struct {
	idx int32 // record index + 1; 0 = holds nothing
	gen uint32
}

// launchFn is a Launch with its kernel's function once the module loaded.
type launchFn struct {
	Launch
	fn cuda.Function
}

// Holds reports whether the ticket holds descriptor buffers.
func (t Ticket) Holds() bool { return t.idx != 0 }

// descBuf is one descriptor buffer: a pinned host staging table the Go side
// writes, the device table the kernel reads, and the launch's parameters.
type descBuf struct {
	host  unsafe.Pointer
	table []desc
	dev   cuda.DevicePtr
	args  [4][]byte
	// targs: a template launch's parameters (table, nt, nb, h2d, and
	// kvo_copy_tmpl_probe's fence_iters and pace_ns).
	targs [6][]byte
}

type ticketRec struct {
	gen  uint32
	live bool
	bufs []*descBuf
	// staging and events: a SubmitGather's staging chunks and events (a
	// kernel launch's one event: done).
	staging []cuda.DevicePtr
	events  []cuda.Event
	// seq orders tickets by acquisition; done (0 until the ticket's work is
	// all enqueued) is recorded after it, on the stream whose completion is
	// the ticket's: a call short of device memory waits for the oldest
	// done event and takes the ticket's memory back early (reclaim).
	seq  uint64
	done cuda.Event
}

// grant is what acquire gave a ticket.
type grant struct {
	bufs    []*descBuf
	staging []cuda.DevicePtr
	events  []cuda.Event
}

// need is what a call asks acquire for.
type need struct{ bufs, staging, events int }

// Copier copies batches of segments on a caller's stream. See the package
// documentation for the ownership rules. A Copier is safe for concurrent
// use; every call that reaches the driver must come from an OS thread with
// the Copier's context current.
type Copier struct {
	drv      cuda.Driver
	opts     Options
	caps     Capabilities
	identity bool

	mod cuda.Module
	// up is the stream kernel launches' descriptor tables are uploaded on
	// (zero with Options.UploadOnCopyStream or without the kernel).
	up cuda.Stream
	// d2h and h2d are the resolved copy launches (D2D takes h2d); stg is
	// the staged copies' device-side kernel (Capabilities.Staged); fill and
	// csum launch kvo_fill and kvo_checksum on h2d's grid.
	d2h, h2d, stg, fill, csum launchFn
	// tmplH2D and tmplD2H are the template launches (template.go), on
	// h2d's and d2h's grids.
	tmplH2D, tmplD2H launchFn

	chooser atomic.Pointer[chooser]
	hosts   atomic.Pointer[hostTable] // copy-on-write; nil entries never

	batchPool sync.Pool // *[]cuda.BatchCopy of cap BatchMax

	mu   sync.Mutex
	cond *sync.Cond // on mu: a ticket's done event set, or a ticket ended
	// tableCap > 0: KeepIdle, the share of MaxDeviceBytes for tables.
	tableCap    int64
	closed      bool
	cal         *Calibration
	free        []*descBuf
	all         []*descBuf
	recs        []ticketRec
	freeRecs    []int32
	outstanding int
	// SubmitGather's device staging chunks and join events: all allocated,
	// and those free for reuse.
	stagingAll, stagingFree []cuda.DevicePtr
	eventsAll, eventsFree   []cuda.Event
	gathers                 atomic.Uint64
	pitched                 atomic.Uint64
	noPitch                 atomic.Bool // SetPitchedStaging(false)
	// Device memory allocated (descriptor tables, staging chunks,
	// Calibrate's buffer): devBytes under mu, mirrored in devNow for
	// lock-free readers, and its peak.
	devBytes        int64
	devNow, devPeak atomic.Int64
	seq             uint64
	budgetWaits     atomic.Int64
}

// New creates a Copier for dev. The calling OS thread must have dev's
// context current. It loads the PTX module (the embedded one, or
// Options.PTX); when that fails the kernel method is unavailable, which is
// an error if Options.Method forces it and otherwise leaves Choose to the
// DMA methods. It allocates Options.DescBuffers descriptor buffers.
func New(drv cuda.Driver, dev cuda.Device, opts Options) (*Copier, error) {
	o := opts.withDefaults()
	sms, err := drv.DeviceAttribute(cuda.AttrMultiprocessorCount, dev)
	if err != nil {
		return nil, fmt.Errorf("cudacopy: SM count: %w", err)
	}
	if err := o.validate(max(sms, 1)); err != nil {
		return nil, err
	}
	ident, err := drv.DeviceAttribute(cuda.AttrCanUseHostPointerForRegisteredMem, dev)
	if err != nil {
		return nil, fmt.Errorf("cudacopy: CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: %w", err)
	}
	c := &Copier{
		drv:      drv,
		opts:     o,
		identity: ident == 1,
		caps: Capabilities{
			Batch:               drv.HasMemcpyBatch(),
			HostPointerIdentity: ident == 1,
			SMs:                 sms,
			D2H:                 o.launch(D2H),
			H2D:                 o.launch(H2D),
			Staged:              o.stagedLaunch(sms),
		},
	}
	c.cond = sync.NewCond(&c.mu)
	c.d2h.Launch, c.h2d.Launch, c.stg.Launch = c.caps.D2H, c.caps.H2D, c.caps.Staged
	c.fill.Launch = Launch{CTAs: c.h2d.CTAs, Threads: c.h2d.Threads, Kernel: "kvo_fill"}
	c.csum.Launch = Launch{CTAs: c.h2d.CTAs, Threads: c.h2d.Threads, Kernel: "kvo_checksum"}
	c.hosts.Store(&hostTable{})
	c.batchPool.New = func() any {
		s := make([]cuda.BatchCopy, o.BatchMax)
		return &s
	}
	if o.Method == MethodBatch && !c.caps.Batch {
		return nil, fmt.Errorf("%w: Method batch forced but the driver has no cuMemcpyBatchAsync (needs ≥ 12.8)", ErrUnavailable)
	}
	if err := c.loadModule(); err != nil {
		c.caps.KernelError = err.Error()
		if o.Method == MethodKernel {
			return nil, fmt.Errorf("cudacopy: Method kernel forced: %w", err)
		}
	} else {
		c.caps.Kernel = true
		if !o.UploadOnCopyStream {
			if c.up, err = drv.StreamCreate(cuda.StreamNonBlocking, 0); err != nil {
				return nil, errors.Join(fmt.Errorf("cudacopy: descriptor upload stream: %w", err), c.release())
			}
		}
		for range min(int64(o.DescBuffers), o.MaxDeviceBytes/c.descBytes()) {
			b, err := c.newDescBuf()
			if err != nil {
				return nil, errors.Join(err, c.release())
			}
			c.free = append(c.free, b)
		}
	}
	c.cal = o.Calibration
	c.chooser.Store(newChooser(o.Calibration, c.caps.Batch, c.caps.Kernel, o.DMAMargin))
	return c, nil
}

func (c *Copier) loadModule() error {
	img := c.opts.PTX
	if len(img) == 0 {
		var err error
		if img, err = PTX(); err != nil {
			return err
		}
	}
	mod, err := c.drv.ModuleLoadData(img)
	if err != nil {
		return fmt.Errorf("%w: loading the PTX module: %w", ErrUnavailable, err)
	}
	for _, l := range []*launchFn{&c.d2h, &c.h2d, &c.stg, &c.fill, &c.csum} {
		if l.fn, err = c.drv.ModuleGetFunction(mod, l.Kernel); err != nil {
			return errors.Join(fmt.Errorf("%w: kernel %s: %w", ErrUnavailable, l.Kernel, err), c.drv.ModuleUnload(mod))
		}
	}
	c.mod = mod
	if _, err := c.drv.ModuleGetFunction(mod, Desc2DKernel); err == nil {
		c.caps.Kernel2D = true
	}
	_ = c.loadTemplates() // Capabilities.Template says whether it found them
	return nil
}

// descBytes is the device memory of one descriptor table.
func (c *Copier) descBytes() int64 { return int64(c.opts.DescCapacity) * descSize }

// newDescBuf allocates a descriptor buffer; the caller holds mu (or is
// New) and has checked that its table fits MaxDeviceBytes.
func (c *Copier) newDescBuf() (*descBuf, error) {
	size := uint64(c.opts.DescCapacity) * descSize
	h, err := c.drv.MemHostAlloc(size, cuda.HostAllocPortable)
	if err != nil {
		return nil, fmt.Errorf("cudacopy: descriptor staging buffer of %d bytes: %w", size, err)
	}
	d, err := c.devAllocLocked(size)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("cudacopy: descriptor table of %d bytes: %w", size, err), c.drv.MemFreeHost(h))
	}
	b := &descBuf{
		host:  h,
		table: unsafe.Slice((*desc)(h), c.opts.DescCapacity),
		dev:   d,
		args:  [4][]byte{make([]byte, 8), make([]byte, 4), make([]byte, 8), make([]byte, 8)},
		targs: [6][]byte{make([]byte, 8), make([]byte, 4), make([]byte, 4), make([]byte, 4), make([]byte, 8), make([]byte, 8)},
	}
	binary.LittleEndian.PutUint64(b.args[0], uint64(d))
	binary.LittleEndian.PutUint64(b.targs[0], uint64(d))
	c.all = append(c.all, b)
	return b, nil
}

// Capabilities reports what New found.
func (c *Copier) Capabilities() Capabilities { return c.caps }

// Options returns the options in force, defaults applied.
func (c *Copier) Options() Options { return c.opts }

// Calibration returns the table Choose uses, or nil before one is installed.
func (c *Copier) Calibration() *Calibration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.cal
}

// SetCalibration installs a table for Choose (nil: the uncalibrated rule).
func (c *Copier) SetCalibration(cal *Calibration) error {
	if cal != nil {
		if err := cal.Validate(); err != nil {
			return err
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.cal = cal
	c.chooser.Store(newChooser(cal, c.caps.Batch, c.caps.Kernel, c.opts.DMAMargin))
	return nil
}

// Choose returns the method Submit would use for this batch under
// MethodAuto: see chooser.choose for the rules. The kernel is only chosen
// for batches whose every address and length is 16-byte aligned.
func (c *Copier) Choose(dir Path, segs []Segment) Method {
	return c.chooser.Load().choose(dir, len(segs), segBytes(segs), aligned(segs))
}

// Close frees the descriptor buffers and unloads the module. The streams
// the Copier enqueued on must be idle; outstanding tickets are ErrInFlight
// (nothing is freed then).
func (c *Copier) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	if c.outstanding > 0 {
		return fmt.Errorf("%w: %d tickets not retired", ErrInFlight, c.outstanding)
	}
	c.closed = true
	return c.release()
}

// release frees every descriptor buffer and the module.
func (c *Copier) release() error {
	var errs []error
	for _, b := range c.all {
		errs = append(errs, c.devFreeLocked(b.dev, uint64(c.descBytes())), c.drv.MemFreeHost(b.host))
	}
	c.all, c.free = nil, nil
	if c.up != 0 {
		errs = append(errs, c.drv.StreamDestroy(c.up))
		c.up = 0
	}
	if c.caps.Kernel {
		errs = append(errs, c.drv.ModuleUnload(c.mod))
	}
	errs = append(errs, c.releaseGatherAll())
	return errors.Join(errs...)
}
