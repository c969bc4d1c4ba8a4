package cudacopy

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
	syncGuard               atomic.Pointer[func(func() error) error]
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
func (c *Copier) Choose(dir Direction, segs []Segment) Method {
	return c.chooser.Load().choose(dir, len(segs), segBytes(segs), aligned(segs))
}

// AddHostRange tells the Copier about a registered host range. Where the
// device cannot use registered host pointers directly it looks up the
// range's device pointer (cuMemHostGetDevicePointer, which needs the range
// registered with CU_MEMHOSTREGISTER_DEVICEMAP) and the kernel then
// translates every host address through this table; otherwise the table
// only records the range.
func (c *Copier) AddHostRange(base uintptr, size uint64) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	r := hostRange{base: uint64(base), size: size, dev: uint64(base)}
	if !c.identity && base != 0 {
		d, err := c.drv.MemHostGetDevicePointer(*(*unsafe.Pointer)(unsafe.Pointer(&base)))
		if err != nil {
			return fmt.Errorf("cudacopy: device pointer of host range %#x+%d: %w", base, size, err)
		}
		r.dev = uint64(d)
	}
	t := &hostTable{ranges: append([]hostRange(nil), c.hosts.Load().ranges...)}
	if err := t.add(r); err != nil {
		return err
	}
	c.hosts.Store(t)
	return nil
}

// RemoveHostRange forgets the range starting at base. The caller must have
// retired every batch that used it.
func (c *Copier) RemoveHostRange(base uintptr) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &hostTable{ranges: append([]hostRange(nil), c.hosts.Load().ranges...)}
	if err := t.remove(uint64(base)); err != nil {
		return err
	}
	c.hosts.Store(t)
	return nil
}

// hostTableForKernel returns the translation table, or nil for identity.
func (c *Copier) hostTableForKernel() *hostTable {
	if c.identity {
		return nil
	}
	return c.hosts.Load()
}

// Submit validates the batch and enqueues its copies on s with the forced
// or chosen method: one cuMemcpyAsync per segment, cuMemcpyBatchAsync calls
// of at most BatchMax copies, or per descriptor buffer an upload of the
// descriptor table and a kvo_copy launch. Nothing is enqueued when
// validation fails.
//
// The caller records an event on s after Submit and calls Retire(ticket)
// once that event has completed; until then the ticket's descriptor buffers
// are not reused. On a driver error Submit returns the zero Ticket: work
// enqueued before the failing call may still run, so its descriptor buffers
// are withdrawn from reuse (and freed only by Close).
//
// Rules for bad input: an empty batch, a zero length, a nil address or a
// wrapping range is ErrInvalidSegment. With MethodKernel forced, a segment
// whose addresses or length are not multiples of 16 is ErrMisaligned;
// MethodAuto never sends such a batch to the kernel.
func (c *Copier) Submit(s cuda.Stream, dir Direction, segs []Segment) (Ticket, error) {
	if !dir.valid() {
		return Ticket{}, fmt.Errorf("%w: direction %d", ErrInvalidOption, int(dir))
	}
	if err := validateSegments(segs, 1); err != nil {
		return Ticket{}, err
	}
	m := c.opts.Method
	if m == MethodAuto {
		m = c.Choose(dir, segs)
	}
	return c.submitWith(s, dir, segs, m)
}

func (c *Copier) submitWith(s cuda.Stream, dir Direction, segs []Segment, m Method) (Ticket, error) {
	switch m {
	case MethodMemcpy:
		return Ticket{}, c.memcpy(s, segs)
	case MethodBatch:
		return Ticket{}, c.batch(s, segs)
	}
	if err := validateSegments(segs, kernelAlign); err != nil {
		return Ticket{}, err
	}
	ck := chunker{
		kind:    jobCopy,
		copies:  segs,
		chunk:   uint64(c.opts.ChunkBytes),
		host:    c.hostTableForKernel(),
		hostSrc: dir == H2D,
		hostDst: dir == D2H,
	}
	l := &c.h2d
	if dir == D2H {
		l = &c.d2h
		ck.fenceIters = uint64(c.fenceBytes(l.Launch, segs) / FenceUnit)
		ck.paceGBps = l.PaceGBps
	}
	return c.launch(s, &ck, l, 0)
}

func (c *Copier) checkOpen() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	return nil
}

func (c *Copier) memcpy(s cuda.Stream, segs []Segment) error {
	if err := c.checkOpen(); err != nil {
		return err
	}
	for i, g := range segs {
		if err := c.drv.MemcpyAsync(cuda.DevicePtr(g.Dst), cuda.DevicePtr(g.Src), g.Len, s); err != nil {
			return fmt.Errorf("cudacopy: memcpy of segment %d of %d (%d bytes): %w", i, len(segs), g.Len, err)
		}
	}
	return nil
}

func (c *Copier) batch(s cuda.Stream, segs []Segment) error {
	if !c.caps.Batch {
		return fmt.Errorf("%w: batch method without cuMemcpyBatchAsync", ErrUnavailable)
	}
	if err := c.checkOpen(); err != nil {
		return err
	}
	sp := c.batchPool.Get().(*[]cuda.BatchCopy)
	defer c.batchPool.Put(sp)
	scratch := *sp
	for base := 0; base < len(segs); base += len(scratch) {
		part := segs[base:min(base+len(scratch), len(segs))]
		for i, g := range part {
			scratch[i] = cuda.BatchCopy{Dst: cuda.DevicePtr(g.Dst), Src: cuda.DevicePtr(g.Src), Size: g.Len}
		}
		if err := c.drv.MemcpyBatchAsync(scratch[:len(part)], s); err != nil {
			return fmt.Errorf("cudacopy: batch copy of segments [%d, %d) of %d: %w", base, base+len(part), len(segs), err)
		}
	}
	return nil
}

// abandon ends a ticket whose launch failed: the first used buffers may
// still be read by enqueued work and are withdrawn; the rest are returned.
func (c *Copier) abandon(t Ticket, used int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	r := &c.recs[t.idx-1]
	c.free = append(c.free, r.bufs[used:]...)
	if used == 0 {
		c.stagingFree = append(c.stagingFree, r.staging...)
		c.eventsFree = append(c.eventsFree, r.events...)
	}
	c.endRec(t.idx - 1)
}

func (c *Copier) endRec(i int32) {
	r := &c.recs[i]
	clear(r.bufs)
	r.bufs = r.bufs[:0]
	r.staging = r.staging[:0]
	r.events = r.events[:0]
	r.done = 0
	r.live = false
	c.cond.Broadcast()
	r.gen++
	c.freeRecs = append(c.freeRecs, i)
	c.outstanding--
}

// launch enqueues, per descriptor buffer, the table upload and one launch of
// fn. For kvo_fill extra is the spin count; for kvo_checksum the output
// array's address (advanced by 8 bytes per descriptor of earlier launches);
// the throttled kernels also get the chunker's fence interval and pace.
func (c *Copier) launch(s cuda.Stream, ck *chunker, l *launchFn, extra uint64) (Ticket, error) {
	if !c.caps.Kernel {
		return Ticket{}, fmt.Errorf("%w: %s", ErrUnavailable, c.caps.KernelError)
	}
	if err := ck.translateAll(); err != nil {
		return Ticket{}, err
	}
	total := ck.count()
	nbuf := (total + c.opts.DescCapacity - 1) / c.opts.DescCapacity
	// The tables go up on c.up unless s is capturing a graph.
	side, err := c.sideUpload(s)
	if err != nil {
		return Ticket{}, err
	}
	events := 1
	if side {
		events += nbuf // one per table: its upload's completion
	}
	t, gr, err := c.acquire(need{bufs: nbuf, events: events})
	if err != nil {
		return Ticket{}, err
	}
	warpsPerCTA := l.Threads / 32
	done := 0
	for i, b := range gr.bufs {
		n, err := ck.next(b.table)
		if err == nil {
			var uploaded cuda.Event
			if side {
				uploaded = gr.events[1+i]
			}
			err = c.enqueue(s, b, l, ck, n, extra, done, warpsPerCTA, uploaded)
		}
		if err != nil {
			// Buffer i's upload may have been enqueued: withdraw it too.
			c.abandon(t, i+1)
			return Ticket{}, err
		}
		done += n
	}
	if err := c.drv.EventRecord(gr.events[0], s); err != nil {
		c.abandon(t, len(gr.bufs))
		return Ticket{}, fmt.Errorf("cudacopy: recording a launch's completion event: %w", err)
	}
	c.setDone(t, gr.events[0])
	return t, nil
}

// enqueue uploads b's first n descriptors (upload: on s, or with an
// uploaded event on the upload stream) and launches l over them on s.
func (c *Copier) enqueue(s cuda.Stream, b *descBuf, l *launchFn, ck *chunker, n int, extra uint64, done, warpsPerCTA int, uploaded cuda.Event) error {
	if err := c.upload(s, b, n*descSize, uploaded); err != nil {
		return err
	}
	binary.LittleEndian.PutUint32(b.args[1], uint32(n))
	args := b.args[:2]
	grid := uint32(min(l.CTAs, (n+warpsPerCTA-1)/warpsPerCTA))
	switch ck.kind {
	case jobFill:
		binary.LittleEndian.PutUint64(b.args[2], extra)
		args = b.args[:3]
	case jobChecksum:
		binary.LittleEndian.PutUint64(b.args[2], extra+uint64(done)*8)
		args = b.args[:3]
	case jobCopy, jobCopy2D:
		if l.Throttled() {
			binary.LittleEndian.PutUint64(b.args[2], ck.fenceIters)
			binary.LittleEndian.PutUint64(b.args[3], paceNs(ck.paceGBps, min(int(grid)*warpsPerCTA, n)))
			args = b.args[:4]
		}
	}
	err := c.drv.LaunchKernel(l.fn, cuda.Dim3{X: grid, Y: 1, Z: 1}, cuda.Dim3{X: uint32(l.Threads), Y: 1, Z: 1}, 0, s, args...)
	if err != nil {
		return fmt.Errorf("cudacopy: launching %d descriptors on %d CTAs: %w", n, grid, err)
	}
	return nil
}

// Retire returns the ticket's descriptor buffers for reuse. Call it only
// after an event recorded on the stream after the Submit has completed.
// Retiring the zero Ticket is a no-op; retiring a ticket twice, or one from
// another Copier, is ErrStaleTicket.
func (c *Copier) Retire(t Ticket) error {
	if !t.Holds() {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	i := t.idx - 1
	if i < 0 || int(i) >= len(c.recs) || !c.recs[i].live || c.recs[i].gen != t.gen {
		return fmt.Errorf("%w: ticket %d/%d", ErrStaleTicket, t.idx, t.gen)
	}
	r := &c.recs[i]
	c.free = append(c.free, r.bufs...)
	c.stagingFree = append(c.stagingFree, r.staging...)
	c.eventsFree = append(c.eventsFree, r.events...)
	c.endRec(i)
	return nil
}

// Fill writes FillPattern(seed) into each segment with kvo_fill, after the
// kernel spins for spinCycles GPU clock cycles (per launch: a batch larger
// than one descriptor buffer spins once per buffer). Addresses and lengths
// must be multiples of 8. Host addresses inside ranges given to AddHostRange
// are translated; others are used as they are. Retire the ticket as for
// Submit.
func (c *Copier) Fill(s cuda.Stream, segs []FillSegment, spinCycles uint64) (Ticket, error) {
	if len(segs) == 0 {
		return Ticket{}, fmt.Errorf("%w: empty batch", ErrInvalidSegment)
	}
	for i, f := range segs {
		if err := checkRange(i, "dst", f.Dst, f.Len); err != nil {
			return Ticket{}, err
		}
		if (f.Dst|f.Len)%wordAlign != 0 {
			return Ticket{}, fmt.Errorf("%w: fill segment %d (dst %#x, len %d) is not %d-byte aligned", ErrMisaligned, i, f.Dst, f.Len, wordAlign)
		}
	}
	ck := chunker{kind: jobFill, fills: segs, chunk: uint64(c.opts.ChunkBytes), host: c.hostTableForKernel()}
	return c.launch(s, &ck, &c.fill, spinCycles)
}

// Checksum writes the checksum of span i (HostChecksum of its bytes) into
// the uint64 at out + 8*i, with kvo_checksum (one warp per span). Addresses
// and lengths must be multiples of 8. Retire the ticket as for Submit.
func (c *Copier) Checksum(s cuda.Stream, spans []Span, out cuda.DevicePtr) (Ticket, error) {
	if len(spans) == 0 {
		return Ticket{}, fmt.Errorf("%w: empty batch", ErrInvalidSegment)
	}
	if out == 0 || out%wordAlign != 0 {
		return Ticket{}, fmt.Errorf("%w: checksum output %#x is nil or not %d-byte aligned", ErrMisaligned, uint64(out), wordAlign)
	}
	for i, sp := range spans {
		if err := checkRange(i, "src", sp.Addr, sp.Len); err != nil {
			return Ticket{}, err
		}
		if (sp.Addr|sp.Len)%wordAlign != 0 {
			return Ticket{}, fmt.Errorf("%w: checksum span %d (addr %#x, len %d) is not %d-byte aligned", ErrMisaligned, i, sp.Addr, sp.Len, wordAlign)
		}
	}
	ck := chunker{kind: jobChecksum, spans: spans, host: c.hostTableForKernel()}
	if h := ck.host; h != nil {
		if d, ok := h.translate(uint64(out), uint64(len(spans))*8); ok {
			out = cuda.DevicePtr(d)
		}
	}
	return c.launch(s, &ck, &c.csum, uint64(out))
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
