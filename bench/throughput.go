package bench

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/transfer/cudacopy"
)

// ThroughputConfig says what MeasureThroughput measures. Zero fields take
// the full defaults (DefaultThroughputConfig).
type ThroughputConfig struct {
	// TotalBytes moved per direction in every run (default 2 GiB).
	TotalBytes uint64 `json:"total_bytes"`
	// SegSizes are the segment sizes (default 4, 16, 64, 256 KiB, 2 MiB).
	SegSizes []uint64 `json:"seg_sizes"`
	// CTAs are the kernel grid sizes measured (default 2, 4, 8, 16), as
	// "kernel/N" rows beside "kernel", the kernel at its default launch per
	// direction (cudacopy.DefaultLaunch).
	CTAs []int `json:"ctas"`
	// Threads per CTA of the "kernel/N" rows (default 1024).
	Threads int `json:"threads"`
	// Reps timed per point after one warm-up (default 5): best and median.
	Reps int `json:"reps"`
	// NoBurn skips the pass beside the matrix product.
	NoBurn bool `json:"no_burn"`
	// BurnN is the matrix size of kvo_sgemm (default 4096; a multiple of 64).
	BurnN int `json:"burn_n"`
	// BurnVariants are the variants measured beside the matrix product
	// (default "auto", "kernel", "kernel/8", "batch"), named as in the
	// results.
	BurnVariants []string `json:"burn_variants"`
	// Seed of the random slot permutations.
	Seed uint64 `json:"seed"`
	// Command is recorded in the results: how the run was started.
	Command string `json:"command"`
	// PTX replaces the embedded kernels.ptx for the copiers and kvo_sgemm
	// (PTX regenerated on the GPU machine before it is committed).
	PTX []byte `json:"-"`
}

// DefaultThroughputConfig is the full benchmark of issue 5.
func DefaultThroughputConfig() ThroughputConfig {
	return ThroughputConfig{}.withDefaults()
}

func (c ThroughputConfig) withDefaults() ThroughputConfig {
	if c.TotalBytes == 0 {
		c.TotalBytes = 2 << 30
	}
	if len(c.SegSizes) == 0 {
		c.SegSizes = cudacopy.DefaultSegSizes
	}
	if len(c.CTAs) == 0 {
		c.CTAs = []int{2, 4, 8, 16}
	}
	if c.Threads == 0 {
		c.Threads = 1024
	}
	if c.Reps == 0 {
		c.Reps = 5
	}
	if c.BurnN == 0 {
		c.BurnN = 4096
	}
	if len(c.BurnVariants) == 0 {
		c.BurnVariants = []string{"auto", "kernel", "kernel/8", "batch"}
	}
	return c
}

func (c ThroughputConfig) validate() error {
	switch {
	case c.Reps < 1:
		return fmt.Errorf("bench: Reps %d is not positive", c.Reps)
	case c.BurnN < 64 || c.BurnN%64 != 0:
		return fmt.Errorf("bench: BurnN %d is not a positive multiple of 64", c.BurnN)
	case c.TotalBytes%4096 != 0:
		return fmt.Errorf("bench: TotalBytes %d is not a multiple of 4096", c.TotalBytes)
	}
	for _, s := range c.SegSizes {
		if s == 0 || s%16 != 0 || c.TotalBytes%s != 0 {
			return fmt.Errorf("bench: segment size %d is not a multiple of 16 dividing TotalBytes %d", s, c.TotalBytes)
		}
	}
	return nil
}

// ThroughputRow is one measured point. Rates are in GB/s (1e9 bytes/s).
type ThroughputRow struct {
	// Method: "contiguous" (one copy of TotalBytes: the link reference),
	// "memcpy", "batch", "kernel" or "auto".
	Method string `json:"method"`
	// CTAs of the kernel (0 for the DMA methods; auto: its configured CTAs).
	CTAs int `json:"ctas"`
	// Dir: "d2h", "h2d" or "both" (two streams at once; rate is the sum).
	Dir string `json:"dir"`
	// SegBytes is the segment size (TotalBytes for contiguous).
	SegBytes uint64 `json:"seg_bytes"`
	// GBps is the best of the reps, MedianGBps their median: the GPU rate,
	// each run enqueued behind a gate (a spin kernel) so that the events
	// time the copies alone, not the CPU building them.
	GBps       float64 `json:"gbps"`
	MedianGBps float64 `json:"median_gbps"`
	// Gated: every timed run's gate outlasted the CPU's enqueueing. False
	// where no gate ran (no kvo_fill, or a submission slower than maxGate/2:
	// then GBps includes the CPU time, which is that method's limit).
	Gated bool `json:"gated"`
	// PipelinedGBps (solo rows): best rate of the same bytes as pipeParts
	// back-to-back Submits per direction with no gate, CPU and GPU
	// overlapping as in a serving engine.
	PipelinedGBps float64 `json:"pipelined_gbps,omitempty"`
	// SubmitNsPerSeg is the median CPU time of the gated runs' Submit calls
	// per segment (descriptor building and upload, or the driver calls).
	SubmitNsPerSeg float64 `json:"submit_ns_per_seg,omitempty"`
	// PctOfLink is GBps against the contiguous reference of the same dir.
	PctOfLink float64 `json:"pct_of_link"`
	// Background: "none", or "sgemm" while kvo_sgemm runs on another stream.
	Background string `json:"background"`
	// PctOfSolo (sgemm rows): GBps against the same point without it.
	PctOfSolo float64 `json:"pct_of_solo,omitempty"`
	// SGEMMSlowdownPct (sgemm rows): how much longer each matrix product
	// took while the transfer ran, against its solo time.
	SGEMMSlowdownPct float64 `json:"sgemm_slowdown_pct,omitempty"`
	// Chosen (auto rows): the method Choose picked ("kernel+batch" for both
	// directions when they differ).
	Chosen string `json:"chosen,omitempty"`
}

// variant names a row's method and grid as "memcpy", "batch", "kernel"
// (default launches), "kernel/8", "auto" (the names BurnVariants uses).
func (r ThroughputRow) variant() string {
	if r.Method == "kernel" && r.CTAs > 0 {
		return fmt.Sprintf("kernel/%d", r.CTAs)
	}
	return r.Method
}

// soloTiming is the row's best run time and submit cost as a timing (for
// besideGemm's sizing of the product queue and the gate).
func (r ThroughputRow) soloTiming(total uint64) timing {
	bytes := total
	if r.Dir == "both" {
		bytes *= 2
	}
	var t timing
	if r.GBps > 0 {
		t.best = float64(bytes) / (r.GBps * 1e6)
	}
	if r.SegBytes > 0 {
		t.submit = time.Duration(r.SubmitNsPerSeg * float64(bytes/r.SegBytes))
	}
	return t
}

// ThroughputResults is everything MeasureThroughput measured (JSON-able).
type ThroughputResults struct {
	Device        string                `json:"device"`
	DriverVersion int                   `json:"driver_version"`
	Capabilities  cudacopy.Capabilities `json:"capabilities"`
	Calibration   *cudacopy.Calibration `json:"calibration"`
	Config        ThroughputConfig      `json:"config"`
	// Link is the contiguous reference each way and both ways at once: the
	// best of LinkBefore (measured before the rows) and LinkAfter (after
	// them). Every row's PctOfLink is against it.
	Link       map[string]float64 `json:"link_gbps"`
	LinkBefore map[string]float64 `json:"link_before_gbps,omitempty"`
	LinkAfter  map[string]float64 `json:"link_after_gbps,omitempty"`
	SGEMM      SGEMMInfo          `json:"sgemm"`
	Rows       []ThroughputRow    `json:"rows"`
	// Invalid lists the rows faster than MaxPctOfLink of the link: the
	// reference was wrong or the row was mis-timed, so no target is
	// reported. Empty when the run is valid.
	Invalid []string `json:"invalid,omitempty"`
}

// hostRegion is an mmap'd, prefaulted, registered host buffer.
type hostRegion struct {
	mem []byte
}

func (h *hostRegion) addr() uint64 { return uint64(uintptr(unsafe.Pointer(&h.mem[0]))) }

func mapHost(drv cuda.Driver, n uint64) (*hostRegion, error) {
	mem, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("bench: mmap of %d bytes: %w", n, err)
	}
	// Huge pages halve registration time (ANCHORS.md); advice only.
	_ = unix.Madvise(mem, unix.MADV_HUGEPAGE)
	const workers = 16
	var wg sync.WaitGroup
	part := (len(mem)/workers + 4095) &^ 4095
	for w := range workers {
		lo, hi := min(w*part, len(mem)), min((w+1)*part, len(mem))
		wg.Go(func() {
			for i := lo; i < hi; i += 4096 {
				mem[i] = byte(i >> 12)
			}
		})
	}
	wg.Wait()
	if err := drv.MemHostRegister(unsafe.Pointer(&mem[0]), n, cuda.HostRegisterPortable|cuda.HostRegisterDeviceMap); err != nil {
		return nil, errors.Join(fmt.Errorf("bench: registering %d bytes: %w", n, err), unix.Munmap(mem))
	}
	return &hostRegion{mem: mem}, nil
}

func (h *hostRegion) free(drv cuda.Driver) error {
	return errors.Join(drv.MemHostUnregister(unsafe.Pointer(&h.mem[0])), unix.Munmap(h.mem))
}

// variant is one copier configuration of the benchmark.
type variant struct {
	name   string
	method cudacopy.Method
	ctas   int
	c      *cudacopy.Copier
	// h2d, when set, submits the H2D side instead of c.
	h2d *cudacopy.Copier
	// fan, when set, spreads a run's DMA submissions over more streams.
	fan *fan
}

// copier is the copier that submits v's segments in d.
func (v *variant) copier(d cudacopy.Direction) *cudacopy.Copier {
	if d == cudacopy.H2D && v.h2d != nil {
		return v.h2d
	}
	return v.c
}

// close closes the copiers of a variant made by sweepVariant (its fan is
// the bench's to release).
func (v *variant) close() error {
	if v.h2d == nil {
		return v.c.Close()
	}
	return errors.Join(v.c.Close(), v.h2d.Close())
}

// methodFor is the method v's copier takes for segs in dir: its forced
// method, or what MethodAuto chooses for them.
func (v *variant) methodFor(d cudacopy.Direction, segs []cudacopy.Segment) cudacopy.Method {
	c := v.copier(d)
	if m := c.Options().Method; m != cudacopy.MethodAuto {
		return m
	}
	return c.Choose(d, segs)
}

// fan is a variant's extra streams per direction ([0] D2H, [1] H2D), each
// with an event that joins it back into the bench's stream of that
// direction. A side submitted with a DMA method spreads its segments over
// them; a kernel side stays on the bench's stream, one launch at a time.
type fan struct {
	s  [2][]cuda.Stream
	ev [2][]cuda.Event
}

// newFan creates n streams and events per direction at priority prio.
func (b *bench) newFan(n, prio int) (*fan, error) {
	f := &fan{}
	for d := range f.s {
		for range n {
			s, err := b.drv.StreamCreate(cuda.StreamNonBlocking, prio)
			if err != nil {
				return nil, err
			}
			b.onClose(func() error { return b.drv.StreamDestroy(s) })
			e, err := b.drv.EventCreate(cuda.EventDisableTiming)
			if err != nil {
				return nil, err
			}
			b.onClose(func() error { return b.drv.EventDestroy(e) })
			f.s[d], f.ev[d] = append(f.s[d], s), append(f.ev[d], e)
		}
	}
	return f, nil
}

// submitSide submits one direction's segments of v: on s, or, for a DMA
// copier with a fan, split evenly over the fan's streams, which start
// after b.ev[0] (the run's start) and join back into s.
func (b *bench) submitSide(v *variant, t *[]tk, s cuda.Stream, d cudacopy.Direction, segs []cudacopy.Segment) error {
	c := v.copier(d)
	side := 0
	if d == cudacopy.H2D {
		side = 1
	}
	if v.fan == nil || c.Options().Method == cudacopy.MethodKernel {
		x, err := c.Submit(s, d, segs)
		if err != nil {
			return err
		}
		*t = append(*t, tk{c, x})
		return nil
	}
	ss, evs := v.fan.s[side], v.fan.ev[side]
	for i, fs := range ss {
		lo, hi := i*len(segs)/len(ss), (i+1)*len(segs)/len(ss)
		if err := b.drv.StreamWaitEvent(fs, b.ev[0], 0); err != nil {
			return err
		}
		if lo < hi {
			x, err := c.Submit(fs, d, segs[lo:hi])
			if err != nil {
				return err
			}
			*t = append(*t, tk{c, x})
		}
		if err := errors.Join(b.drv.EventRecord(evs[i], fs), b.drv.StreamWaitEvent(s, evs[i], 0)); err != nil {
			return err
		}
	}
	return nil
}

// bench holds the resources of one MeasureThroughput call.
type bench struct {
	drv        cuda.Driver
	cfg        ThroughputConfig
	s          [2]cuda.Stream // [0]: D2H, [1]: H2D; transfer priority
	burn       cuda.Stream
	ev         [4]cuda.Event // start, H2D side's end, end, D2H side's end
	mod        cuda.Module
	modLoaded  bool
	gate       *gate       // nil: runs are timed ungated
	hostA      *hostRegion // D2H destination
	hostB      *hostRegion // H2D source
	devA, devB cuda.DevicePtr
	variants   []*variant
	cleanup    []func() error
}

func (b *bench) onClose(f func() error) { b.cleanup = append(b.cleanup, f) }

func (b *bench) close() error {
	var errs []error
	for i := len(b.cleanup) - 1; i >= 0; i-- {
		errs = append(errs, b.cleanup[i]())
	}
	return errors.Join(errs...)
}

// MeasureThroughput runs the transfer benchmark of issue 5 in one process:
// the contiguous link reference each way and both ways at once, then
// TotalBytes of segments at random slots on both sides for every segment
// size, method (memcpy, batch, kernel at each CTAs, auto after Calibrate)
// and direction (d2h, h2d, both on two streams), best and median of Reps
// timed with CUDA events; then the burn variants again while kvo_sgemm runs
// on a third, low-priority stream. The calling goroutine must be locked to
// an OS thread with dev's context current.
func MeasureThroughput(drv cuda.Driver, dev cuda.Device, cfg ThroughputConfig) (res ThroughputResults, err error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return res, err
	}
	res.Config = cfg
	res.Link = map[string]float64{}
	if res.Device, err = drv.DeviceName(dev); err != nil {
		return res, err
	}
	if res.DriverVersion, err = drv.DriverVersion(); err != nil {
		return res, err
	}
	b := &bench{drv: drv, cfg: cfg}
	defer func() { err = errors.Join(err, b.close()) }()
	if err := b.setup(dev); err != nil {
		return res, err
	}
	auto := b.variants[len(b.variants)-1].c
	res.Capabilities = auto.Capabilities()
	if res.Calibration, err = auto.Calibrate(b.s[0]); err != nil {
		return res, fmt.Errorf("bench: calibration: %w", err)
	}
	if err := b.link(&res); err != nil {
		return res, err
	}
	defer func() {
		if err == nil {
			err = b.relink(&res)
		}
	}()
	solo := map[string]ThroughputRow{}
	for _, size := range cfg.SegSizes {
		segs := b.segments(size)
		for _, v := range b.variants {
			for _, dir := range []string{"d2h", "h2d", "both"} {
				row, err := b.scattered(&res, v, dir, size, segs, nil)
				if err != nil {
					return res, err
				}
				res.Rows = append(res.Rows, row)
				solo[row.variant()+"/"+dir+"/"+strconv.FormatUint(size, 10)] = row
			}
		}
	}
	if cfg.NoBurn {
		res.SGEMM.Skipped = "disabled (NoBurn)"
		return res, nil
	}
	return res, b.burnPass(&res, solo)
}

func (b *bench) setup(dev cuda.Device) error {
	if err := b.setupBase(); err != nil {
		return err
	}
	return b.setupCopiers(dev)
}

// setupBase creates the streams, events and buffers: everything but the
// copiers.
func (b *bench) setupBase() error {
	drv, cfg := b.drv, b.cfg
	least, greatest, err := drv.StreamPriorityRange()
	if err != nil {
		return err
	}
	if b.s, err = b.streamPair(greatest); err != nil {
		return err
	}
	if b.burn, err = drv.StreamCreate(cuda.StreamNonBlocking, least); err != nil {
		return err
	}
	b.onClose(func() error { return drv.StreamDestroy(b.burn) })
	for i := range b.ev {
		if b.ev[i], err = drv.EventCreate(cuda.EventDefault); err != nil {
			return err
		}
		e := b.ev[i]
		b.onClose(func() error { return drv.EventDestroy(e) })
	}
	if err := b.setupGate(); err != nil {
		return err
	}
	for _, h := range []**hostRegion{&b.hostA, &b.hostB} {
		r, err := mapHost(drv, cfg.TotalBytes)
		if err != nil {
			return err
		}
		*h = r
		b.onClose(func() error { return r.free(drv) })
	}
	for _, d := range []*cuda.DevicePtr{&b.devA, &b.devB} {
		p, err := drv.MemAlloc(cfg.TotalBytes)
		if err != nil {
			return fmt.Errorf("bench: device buffer of %d bytes: %w", cfg.TotalBytes, err)
		}
		*d = p
		b.onClose(func() error { return drv.MemFree(p) })
	}
	return nil
}

// streamPair creates the D2H and H2D streams at priority prio.
func (b *bench) streamPair(prio int) ([2]cuda.Stream, error) {
	var ss [2]cuda.Stream
	for i := range ss {
		s, err := b.drv.StreamCreate(cuda.StreamNonBlocking, prio)
		if err != nil {
			return ss, err
		}
		ss[i] = s
		b.onClose(func() error { return b.drv.StreamDestroy(s) })
	}
	return ss, nil
}

// newCopier creates a copier that knows both host buffers.
func (b *bench) newCopier(dev cuda.Device, o cudacopy.Options) (*cudacopy.Copier, error) {
	o.PTX = b.cfg.PTX
	c, err := cudacopy.New(b.drv, dev, o)
	if err != nil {
		return nil, err
	}
	for _, h := range []*hostRegion{b.hostA, b.hostB} {
		if err := c.AddHostRange(uintptr(unsafe.Pointer(&h.mem[0])), b.cfg.TotalBytes); err != nil {
			return nil, errors.Join(err, c.Close())
		}
	}
	return c, nil
}

func (b *bench) setupCopiers(dev cuda.Device) error {
	drv, cfg := b.drv, b.cfg
	specs := []variant{{name: "memcpy", method: cudacopy.MethodMemcpy}}
	if drv.HasMemcpyBatch() {
		specs = append(specs, variant{name: "batch", method: cudacopy.MethodBatch})
	}
	specs = append(specs, variant{name: "kernel", method: cudacopy.MethodKernel})
	for _, n := range cfg.CTAs {
		specs = append(specs, variant{name: fmt.Sprintf("kernel/%d", n), method: cudacopy.MethodKernel, ctas: n})
	}
	specs = append(specs, variant{name: "auto", method: cudacopy.MethodAuto})
	for _, v := range specs {
		o := cudacopy.Options{Method: v.method}
		if v.ctas > 0 {
			// The kernel rows: kvo_copy, unthrottled, both ways.
			o.CTAs, o.Threads, o.CopyKernel = v.ctas, cfg.Threads, cudacopy.DefaultCopyKernel
		}
		c, err := b.newCopier(dev, o)
		if err != nil {
			return fmt.Errorf("bench: copier %s: %w", v.name, err)
		}
		b.onClose(c.Close)
		v.c = c
		b.variants = append(b.variants, &v)
	}
	return nil
}

// segSet is the D2H (devA → hostA) and H2D (hostB → devB) segments of one size.
type segSet struct{ d2h, h2d []cudacopy.Segment }

func (b *bench) segments(size uint64) segSet {
	rng := rand.New(rand.NewPCG(b.cfg.Seed, size))
	n := int(b.cfg.TotalBytes / size)
	return segSet{
		d2h: cudacopy.ScatteredSegments(cudacopy.D2H, b.hostA.addr(), uint64(b.devA), size, n, rng),
		h2d: cudacopy.ScatteredSegments(cudacopy.H2D, b.hostB.addr(), uint64(b.devB), size, n, rng),
	}
}

// Segments per Submit when both directions interleave: small enough that
// the second stream starts early, and where both directions take the
// kernel (forced, or chosen by MethodAuto for the whole run) one full
// descriptor buffer, so that parts do not each hold a mostly empty buffer.
// MethodAuto is submitted in the parts of the method it takes: in kernel
// parts, a run that took the batch API both ways left the H2D stream idle
// while the CPU enqueued the D2H side, and ran well below the forced batch
// API.
const (
	dmaPart    = 8192
	kernelPart = cudacopy.DefaultDescCapacity
)

// enqueueFor returns the submission of one run of v in dir.
func (b *bench) enqueueFor(v *variant, dir string, segs segSet) func(*[]tk) error {
	switch dir {
	case "d2h":
		return func(t *[]tk) error { return b.submitSide(v, t, b.s[0], cudacopy.D2H, segs.d2h) }
	case "h2d":
		return func(t *[]tk) error { return b.submitSide(v, t, b.s[1], cudacopy.H2D, segs.h2d) }
	}
	part := dmaPart
	if v.methodFor(cudacopy.D2H, segs.d2h) == cudacopy.MethodKernel && v.methodFor(cudacopy.H2D, segs.h2d) == cudacopy.MethodKernel {
		part = kernelPart
	}
	if v.fan != nil && v.methodFor(cudacopy.D2H, segs.d2h) != cudacopy.MethodKernel && v.methodFor(cudacopy.H2D, segs.h2d) != cudacopy.MethodKernel {
		// Both sides are fanned: each is one submission per stream already.
		part = len(segs.d2h)
	}
	return func(t *[]tk) error {
		for lo := 0; lo < len(segs.d2h); lo += part {
			hi := min(lo+part, len(segs.d2h))
			if err := b.submitSide(v, t, b.s[0], cudacopy.D2H, segs.d2h[lo:hi]); err != nil {
				return err
			}
			if err := b.submitSide(v, t, b.s[1], cudacopy.H2D, segs.h2d[lo:hi]); err != nil {
				return err
			}
		}
		return nil
	}
}

// pipeParts is how many back-to-back Submits the pipelined run splits a
// direction's segments into: what a serving engine does, building the next
// batch's descriptors while earlier copies are in flight.
const pipeParts = 8

// pipelinedFor returns the pipelined submission of one run of v in dir:
// each direction's segments in pipeParts Submits (interleaved for "both").
func (b *bench) pipelinedFor(v *variant, dir string, segs segSet) func(*[]tk) error {
	type side struct {
		s    cuda.Stream
		d    cudacopy.Direction
		segs []cudacopy.Segment
	}
	var sides []side
	if dir != "h2d" {
		sides = append(sides, side{b.s[0], cudacopy.D2H, segs.d2h})
	}
	if dir != "d2h" {
		sides = append(sides, side{b.s[1], cudacopy.H2D, segs.h2d})
	}
	return func(t *[]tk) error {
		for p := range pipeParts {
			for _, sd := range sides {
				n := len(sd.segs)
				lo, hi := p*n/pipeParts, (p+1)*n/pipeParts
				if lo == hi {
					continue
				}
				if err := b.submitSide(v, t, sd.s, sd.d, sd.segs[lo:hi]); err != nil {
					return err
				}
			}
		}
		return nil
	}
}

// scattered measures v in dir at one segment size: the gated GPU rate, the
// pipelined rate and the CPU submit cost. With burn set, the runs happen
// beside it (see burnPass) and only the gated figures are filled.
func (b *bench) scattered(res *ThroughputResults, v *variant, dir string, size uint64, segs segSet, burn func(enqueue func(*[]tk) error) (timing, error)) (ThroughputRow, error) {
	bytes := b.cfg.TotalBytes
	nsegs := len(segs.d2h)
	if dir == "both" {
		bytes *= 2
		nsegs *= 2
	}
	enqueue := b.enqueueFor(v, dir, segs)
	fail := func(what string, err error) (ThroughputRow, error) {
		return ThroughputRow{}, fmt.Errorf("bench: %s %s at %s (%s): %w", v.name, dir, cudacopy.FormatBytes(size), what, err)
	}
	var tm timing
	var err error
	if burn != nil {
		tm, err = burn(enqueue)
	} else {
		tm, err = b.reps(enqueue, true)
	}
	if err != nil {
		return fail("gated", err)
	}
	row := ThroughputRow{
		Method:         v.method.String(),
		CTAs:           v.ctas,
		Dir:            dir,
		SegBytes:       size,
		GBps:           gbps(bytes, tm.best),
		MedianGBps:     gbps(bytes, tm.median),
		Gated:          tm.held,
		SubmitNsPerSeg: float64(tm.submit.Nanoseconds()) / float64(nsegs),
		Background:     "none",
	}
	switch {
	case burn != nil:
	case tm.ungated:
		// The same driver calls, ungated, were just timed: splitting a
		// submission slower than maxGate/2 into pipeParts changes nothing
		// the GPU sees, so its pipelined rate is that run's.
		row.PipelinedGBps = row.GBps
	default:
		pipe, err := b.reps(b.pipelinedFor(v, dir, segs), false)
		if err != nil {
			return fail("pipelined", err)
		}
		row.PipelinedGBps = gbps(bytes, pipe.best)
	}
	if l := res.Link[dir]; l > 0 {
		row.PctOfLink = 100 * row.GBps / l
	}
	if v.method == cudacopy.MethodAuto {
		d, h := v.c.Choose(cudacopy.D2H, segs.d2h), v.c.Choose(cudacopy.H2D, segs.h2d)
		switch {
		case dir == "d2h":
			row.Chosen = d.String()
		case dir == "h2d" || d == h:
			row.Chosen = h.String()
		default:
			row.Chosen = d.String() + "+" + h.String()
		}
	}
	return row, nil
}

// module loads the PTX (cfg.PTX or the embedded one) once; skipped says
// why there is none.
func (b *bench) module() (mod cuda.Module, skipped string, err error) {
	if b.modLoaded {
		return b.mod, "", nil
	}
	drv := b.drv
	img := b.cfg.PTX
	if len(img) == 0 {
		if img, err = cudacopy.PTX(); err != nil {
			return mod, err.Error(), nil
		}
	}
	if mod, err = drv.ModuleLoadData(img); err != nil {
		return mod, "", fmt.Errorf("bench: loading the PTX: %w", err)
	}
	b.onClose(func() error { return drv.ModuleUnload(mod) })
	b.mod, b.modLoaded = mod, true
	return mod, "", nil
}
