package bench

import (
	"cmp"
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
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

// SGEMMInfo describes the matrix product of the burn pass.
type SGEMMInfo struct {
	N      int     `json:"n"`
	SoloMs float64 `json:"solo_ms"`
	TFLOPS float64 `json:"tflops"`
	// Skipped says why the burn pass did not run, if it did not.
	Skipped string `json:"skipped,omitempty"`
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

// MaxPctOfLink is the most a row may reach against the contiguous link
// before the run is invalid: a scattered copy cannot beat one contiguous
// copy of the same bytes by more than measurement noise.
const MaxPctOfLink = 102

// LinkVerdict checks rows against link (GB/s by direction): one line per
// row above MaxPctOfLink of its direction's link, or per row whose
// direction has no link measured. No lines: the run is valid.
func LinkVerdict(link map[string]float64, rows []ThroughputRow) []string {
	var bad []string
	for _, row := range rows {
		if row.Method == "contiguous" {
			continue
		}
		l := link[row.Dir]
		name := fmt.Sprintf("%s %s %s (%s)", row.variant(), row.Dir, cudacopy.FormatBytes(row.SegBytes), row.Background)
		switch {
		case l <= 0:
			bad = append(bad, fmt.Sprintf("%s: no %s link reference", name, row.Dir))
		case 100*row.GBps/l > MaxPctOfLink:
			bad = append(bad, fmt.Sprintf("%s: %.1f GB/s = %.1f%% of the link (%.1f GB/s), above %d%%", name, row.GBps, 100*row.GBps/l, l, MaxPctOfLink))
		}
	}
	return bad
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

// gate holds a stream behind a kvo_fill launch that only spins (no
// descriptors), so that everything enqueued behind it starts at once: the
// timed region then holds GPU work alone, not the CPU time of building and
// enqueueing it. A CUDA event cannot be signalled by the host, hence the
// spin, sized from a measured submit time.
type gate struct {
	fn          cuda.Function
	table       cuda.DevicePtr // 32 bytes, never read (n = 0)
	cyclesPerMs float64        // GPU clock, measured with events
}

// Bounds of the gate: the margin added to twice the measured submit time,
// and the longest gate used; a submission slower than half of it (one
// memcpy per 4 KiB segment of 2 GiB) is timed ungated, as its rate is its
// CPU cost whatever the GPU does.
const (
	gateMargin = 200 * time.Microsecond
	maxGate    = 250 * time.Millisecond
)

// setupGate loads kvo_fill from the bench's module and measures the GPU
// clock; without the kernel the runs are timed ungated (b.gate nil).
func (b *bench) setupGate() error {
	drv := b.drv
	mod, skipped, err := b.module()
	if err != nil || skipped != "" {
		return err
	}
	fn, err := drv.ModuleGetFunction(mod, "kvo_fill")
	if err != nil {
		return nil
	}
	table, err := drv.MemAlloc(32)
	if err != nil {
		return fmt.Errorf("bench: gate table: %w", err)
	}
	b.onClose(func() error { return drv.MemFree(table) })
	g := &gate{fn: fn, table: table}
	const probe = 2_000_000
	var ms float32
	for range 2 {
		err := errors.Join(drv.EventRecord(b.ev[0], b.s[0]), g.launch(drv, b.s[0], probe), drv.EventRecord(b.ev[2], b.s[0]))
		if err == nil {
			err = drv.StreamSynchronize(b.s[0])
		}
		if err == nil {
			ms, err = drv.EventElapsedTime(b.ev[0], b.ev[2])
		}
		if err != nil {
			return fmt.Errorf("bench: gate clock: %w", err)
		}
	}
	if ms <= 0 {
		return fmt.Errorf("bench: gate clock: a spin of %d cycles took %v ms", probe, ms)
	}
	g.cyclesPerMs = probe / float64(ms)
	b.gate = g
	return nil
}

func (g *gate) launch(drv cuda.Driver, s cuda.Stream, cycles uint64) error {
	return drv.LaunchKernel(g.fn, cuda.Dim3{X: 1, Y: 1, Z: 1}, cuda.Dim3{X: 32, Y: 1, Z: 1}, 0, s, cuda.Arg(uint64(g.table)), cuda.Arg(uint32(0)), cuda.Arg(cycles))
}

// run is one timed run: GPU time between the events, CPU time of enqueue,
// and whether the gate (if any) still held when enqueue returned.
type run struct {
	ms     float64
	submit time.Duration
	held   bool
	// sideMs is when each stream's work ended ([0] b.s[0], the D2H side;
	// [1] b.s[1], the H2D side), from the same start as ms.
	sideMs [2]float64
}

// measure times enqueue (which submits on b.s[0] and/or b.s[1]) between
// events that order both streams, and retires its tickets. With hold > 0
// (and a gate) both streams first wait behind a spin of that length, so the
// events time the GPU work alone; held reports whether the spin outlasted
// the CPU's enqueueing (else the time includes some of it).
func (b *bench) measure(enqueue func(tickets *[]tk) error, hold time.Duration) (run, error) {
	drv := b.drv
	gated := hold > 0 && b.gate != nil
	if gated {
		if err := b.gate.launch(drv, b.s[0], uint64(float64(hold.Nanoseconds())/1e6*b.gate.cyclesPerMs)); err != nil {
			return run{}, err
		}
	}
	if err := drv.EventRecord(b.ev[0], b.s[0]); err != nil {
		return run{}, err
	}
	if err := drv.StreamWaitEvent(b.s[1], b.ev[0], 0); err != nil {
		return run{}, err
	}
	var tickets []tk
	t0 := time.Now()
	err := enqueue(&tickets)
	r := run{submit: time.Since(t0)}
	if err == nil && gated {
		var started bool
		started, err = drv.EventQuery(b.ev[0])
		r.held = !started
	}
	if err == nil {
		err = errors.Join(drv.EventRecord(b.ev[3], b.s[0]), drv.EventRecord(b.ev[1], b.s[1]), drv.StreamWaitEvent(b.s[0], b.ev[1], 0), drv.EventRecord(b.ev[2], b.s[0]))
	}
	err = errors.Join(err, drv.StreamSynchronize(b.s[0]), drv.StreamSynchronize(b.s[1]))
	for _, t := range tickets {
		err = errors.Join(err, t.c.Retire(t.t))
	}
	if err != nil {
		return run{}, err
	}
	for i, e := range []cuda.Event{b.ev[3], b.ev[1], b.ev[2]} {
		ms, err := drv.EventElapsedTime(b.ev[0], e)
		if err != nil {
			return run{}, err
		}
		if i < 2 {
			r.sideMs[i] = float64(ms)
		} else {
			r.ms = float64(ms)
		}
	}
	return r, nil
}

type tk struct {
	c *cudacopy.Copier
	t cudacopy.Ticket
}

// timing summarises the timed runs of one point.
type timing struct {
	best, median float64       // ms
	bestSides    [2]float64    // the best run's sideMs
	submit       time.Duration // median CPU time of enqueue
	held         bool          // every run was gated and the gate held
	ungated      bool          // no gate ran: the submission exceeds maxGate/2 (or no kvo_fill)
}

// slowRunMs: a point whose warm-up took longer gets at most slowReps timed
// runs, which keeps the full benchmark within minutes (one memcpy per 4 KiB
// segment of 2 GiB takes over a second a run).
const (
	slowRunMs = 400
	slowReps  = 2
)

// holdFor is the gate for a submission that took submit on the CPU: twice
// that plus gateMargin, or 0 (ungated) beyond maxGate.
func holdFor(submit time.Duration) time.Duration {
	if h := 2*submit + gateMargin; h <= maxGate {
		return h
	}
	return 0
}

// reps runs one ungated warm-up and cfg.Reps timed runs (slowReps after a
// slow warm-up). With gated set, each timed run waits behind a gate of
// twice the warm-up's submit time plus gateMargin (none when that exceeds
// maxGate).
func (b *bench) reps(enqueue func(tickets *[]tk) error, gated bool) (timing, error) {
	return b.repsN(enqueue, gated, b.cfg.Reps)
}

// repsN is reps with n timed runs instead of cfg.Reps.
func (b *bench) repsN(enqueue func(tickets *[]tk) error, gated bool, n int) (timing, error) {
	warm, err := b.measure(enqueue, 0)
	if err != nil {
		return timing{}, err
	}
	if warm.ms > slowRunMs {
		n = min(n, slowReps)
	}
	var hold time.Duration
	if gated && b.gate != nil {
		hold = holdFor(warm.submit)
	}
	times := make([]float64, 0, n)
	subs := make([]time.Duration, 0, n)
	held := hold > 0
	ungated := hold == 0
	var sides [2]float64
	for range n {
		r, err := b.measure(enqueue, hold)
		if err != nil {
			return timing{}, err
		}
		if len(times) == 0 || r.ms < slices.Min(times) {
			sides = r.sideMs
		}
		times = append(times, r.ms)
		subs = append(subs, r.submit)
		held = held && r.held
	}
	slices.Sort(times)
	slices.Sort(subs)
	return timing{best: times[0], median: times[len(times)/2], bestSides: sides, submit: subs[len(subs)/2], held: held, ungated: ungated}, nil
}

func gbps(bytes uint64, ms float64) float64 { return float64(bytes) / (ms * 1e6) }

// Link reference: linkWarm of contiguous copies both ways (at most
// linkWarmRuns runs) before the timed runs, which are at least linkReps.
// A link that idles may run below its speed at first (power states, a
// PCIe link trained down), and one warm-up copy was not enough: a run on
// the H200 measured 46 GB/s against 55 in another program the same minute.
const (
	linkWarm     = 500 * time.Millisecond
	linkWarmRuns = 64
	linkReps     = 8
)

// measureLink times the contiguous reference: TotalBytes in one copy
// devA → hostA on b.s[0] (d2h), hostB → devB on b.s[1] (h2d), and both at
// once (separate streams and buffers), after a warm-up of both ways.
func (b *bench) measureLink() (map[string]timing, error) {
	n := b.cfg.TotalBytes
	d2h := func(tickets *[]tk) error {
		return b.drv.MemcpyAsync(cuda.DevicePtr(b.hostA.addr()), b.devA, n, b.s[0])
	}
	h2d := func(tickets *[]tk) error {
		return b.drv.MemcpyAsync(b.devB, cuda.DevicePtr(b.hostB.addr()), n, b.s[1])
	}
	both := func(t *[]tk) error { return errors.Join(d2h(t), h2d(t)) }
	start := time.Now()
	for i := 0; i < linkWarmRuns && time.Since(start) < linkWarm; i++ {
		if _, err := b.measure(both, 0); err != nil {
			return nil, fmt.Errorf("bench: contiguous warm-up: %w", err)
		}
	}
	out := map[string]timing{}
	for _, c := range []struct {
		dir string
		f   func(*[]tk) error
	}{{"d2h", d2h}, {"h2d", h2d}, {"both", both}} {
		tm, err := b.repsN(c.f, true, max(b.cfg.Reps, linkReps))
		if err != nil {
			return nil, fmt.Errorf("bench: contiguous %s: %w", c.dir, err)
		}
		out[c.dir] = tm
	}
	return out, nil
}

// linkBytes is the bytes one contiguous run of dir moves.
func (b *bench) linkBytes(dir string) uint64 {
	if dir == "both" {
		return 2 * b.cfg.TotalBytes
	}
	return b.cfg.TotalBytes
}

// link measures the contiguous reference into res.Link and
// res.LinkBefore and appends its rows.
func (b *bench) link(res *ThroughputResults) error {
	tms, err := b.measureLink()
	if err != nil {
		return err
	}
	res.LinkBefore = map[string]float64{}
	for _, dir := range []string{"d2h", "h2d", "both"} {
		tm := tms[dir]
		g := gbps(b.linkBytes(dir), tm.best)
		res.Link[dir], res.LinkBefore[dir] = g, g
		res.Rows = append(res.Rows, ThroughputRow{Method: "contiguous", Dir: dir, SegBytes: b.cfg.TotalBytes, GBps: g, MedianGBps: gbps(b.linkBytes(dir), tm.median), PctOfLink: 100, Background: "none", Gated: tm.held})
	}
	return nil
}

// relink measures the reference again after the rows (res.LinkAfter),
// keeps the faster of the two per direction as res.Link (and in the
// contiguous rows), recomputes every row's PctOfLink against it, and
// records the rows above MaxPctOfLink in res.Invalid.
func (b *bench) relink(res *ThroughputResults) error {
	tms, err := b.measureLink()
	if err != nil {
		return err
	}
	res.LinkAfter = map[string]float64{}
	for i := range res.Rows {
		row := &res.Rows[i]
		if row.Method != "contiguous" {
			continue
		}
		tm := tms[row.Dir]
		g := gbps(b.linkBytes(row.Dir), tm.best)
		res.LinkAfter[row.Dir] = g
		if g > row.GBps {
			row.GBps, row.MedianGBps, row.Gated = g, gbps(b.linkBytes(row.Dir), tm.median), tm.held
			res.Link[row.Dir] = g
		}
	}
	for i := range res.Rows {
		if l := res.Link[res.Rows[i].Dir]; l > 0 {
			res.Rows[i].PctOfLink = 100 * res.Rows[i].GBps / l
		}
	}
	res.Invalid = LinkVerdict(res.Link, res.Rows)
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
// while the CPU enqueued the D2H side (both ways at 64 KiB: 77 GB/s,
// against 96 forced; git show 5fe4e35:bench/results/2026-11-30-h200/throughput.csv).
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

// burnPass measures the burn variants while kvo_sgemm runs on b.burn.
func (b *bench) burnPass(res *ThroughputResults, solo map[string]ThroughputRow) error {
	cfg := b.cfg
	g, info, err := b.soloGemm()
	res.SGEMM = info
	if err != nil || g == nil {
		return err
	}
	byName := map[string]*variant{}
	for _, v := range b.variants {
		byName[v.name] = v
	}
	for _, size := range cfg.SegSizes {
		segs := b.segments(size)
		for _, name := range cfg.BurnVariants {
			v, ok := byName[name]
			if !ok {
				continue
			}
			for _, dir := range []string{"d2h", "h2d", "both"} {
				key := name + "/" + dir + "/" + strconv.FormatUint(size, 10)
				var slow float64
				burn := func(enqueue func(*[]tk) error) (timing, error) {
					tm, s, err := b.besideGemm(g, res.SGEMM.SoloMs, solo[key].soloTiming(cfg.TotalBytes), enqueue)
					slow = s
					return tm, err
				}
				row, err := b.scattered(res, v, dir, size, segs, burn)
				if err != nil {
					return err
				}
				row.Background = "sgemm"
				row.SGEMMSlowdownPct = slow
				if s := solo[key].GBps; s > 0 {
					row.PctOfSolo = 100 * row.GBps / s
				}
				res.Rows = append(res.Rows, row)
			}
		}
	}
	return nil
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

// newGemm loads kvo_sgemm and allocates its BurnN × BurnN matrices; skipped
// says why it cannot run where the PTX lacks it.
func (b *bench) newGemm() (g *gemm, skipped string, err error) {
	drv := b.drv
	mod, skipped, err := b.module()
	if err != nil || skipped != "" {
		return nil, skipped, err
	}
	fn, err := drv.ModuleGetFunction(mod, "kvo_sgemm")
	if err != nil {
		return nil, fmt.Sprintf("kvo_sgemm not in the PTX (regenerate it with `make ptx`): %v", err), nil
	}
	n := uint64(b.cfg.BurnN)
	var mats [3]cuda.DevicePtr
	for i := range mats {
		if mats[i], err = drv.MemAlloc(n * n * 4); err != nil {
			return nil, "", fmt.Errorf("bench: sgemm matrix of %d bytes: %w", n*n*4, err)
		}
		p := mats[i]
		b.onClose(func() error { return drv.MemFree(p) })
		// 0x3c3c3c3c is about 0.0115: finite products, no overflow.
		if err := drv.MemsetD8(p, 0x3c, n*n*4); err != nil {
			return nil, "", err
		}
	}
	return &gemm{drv: drv, fn: fn, s: b.burn, n: uint32(n), args: [][]byte{cuda.Arg(uint64(mats[0])), cuda.Arg(uint64(mats[1])), cuda.Arg(uint64(mats[2])), cuda.Arg(uint32(n))}}, "", nil
}

// soloGemm makes the matrix product (nil, with info.Skipped saying why,
// where the PTX has no kvo_sgemm) and times it alone.
func (b *bench) soloGemm() (g *gemm, info SGEMMInfo, err error) {
	info.N = b.cfg.BurnN
	if g, info.Skipped, err = b.newGemm(); err != nil || g == nil {
		return nil, info, err
	}
	if info.SoloMs, err = g.solo(b.ev[0], b.ev[2], 5); err != nil {
		return nil, info, fmt.Errorf("bench: sgemm solo: %w", err)
	}
	n := float64(info.N)
	info.TFLOPS = 2 * n * n * n / (info.SoloMs * 1e9)
	return g, info, nil
}

// Bounds of the burn pass: timed reps per point (no warm-up: the products
// are already running) and products queued per point.
const (
	burnReps        = 3
	maxBurnLaunches = 600
)

// gemm launches kvo_sgemm.
type gemm struct {
	drv  cuda.Driver
	fn   cuda.Function
	s    cuda.Stream
	n    uint32
	args [][]byte
}

func (g *gemm) launch() error {
	t := g.n / 64
	return g.drv.LaunchKernel(g.fn, cuda.Dim3{X: t, Y: t, Z: 1}, cuda.Dim3{X: 256, Y: 1, Z: 1}, 0, g.s, g.args...)
}

// solo returns the median time of one product alone, over reps.
func (g *gemm) solo(start, end cuda.Event, reps int) (float64, error) {
	times := make([]float64, 0, reps)
	for r := range reps + 1 {
		err := errors.Join(g.drv.EventRecord(start, g.s), g.launch(), g.drv.EventRecord(end, g.s))
		if err == nil {
			err = g.drv.EventSynchronize(end)
		}
		if err != nil {
			return 0, err
		}
		ms, err := g.drv.EventElapsedTime(start, end)
		if err != nil {
			return 0, err
		}
		if r > 0 {
			times = append(times, float64(ms))
		}
	}
	slices.Sort(times)
	return times[len(times)/2], nil
}

// besideGemm runs the timed reps of enqueue, gated as solo's submit time
// asks, while a queue of products runs on the burn stream: the transfers
// start after two products, and the products outlast them. It returns the
// transfer's timing and the mean slowdown (%) of the products that ran
// entirely within a rep's timed window (gates excluded), or, if none did,
// of those that overlapped one.
func (b *bench) besideGemm(g *gemm, soloMs float64, solo timing, enqueue func(*[]tk) error) (tm timing, slowPct float64, err error) {
	drv := b.drv
	reps := min(b.cfg.Reps, burnReps)
	hold := time.Duration(0)
	if b.gate != nil {
		hold = holdFor(solo.submit)
	}
	expectMs := 1.0
	if solo.best > 0 {
		expectMs = (solo.best + float64(hold.Microseconds())/1e3) * float64(reps)
	}
	// Three times the solo transfer time, so the products outlast a
	// transfer slowed by them; bounded to keep the launch queue short.
	count := min(int(math.Ceil(3*expectMs/soloMs))+4, maxBurnLaunches)
	evs := make([]cuda.Event, count+1)
	for i := range evs {
		if evs[i], err = drv.EventCreate(cuda.EventDefault); err != nil {
			return tm, 0, err
		}
		e := evs[i]
		defer func() { err = errors.Join(err, drv.EventDestroy(e)) }()
	}
	for i := range count {
		if err := errors.Join(drv.EventRecord(evs[i], g.s), g.launch()); err != nil {
			return tm, 0, err
		}
	}
	if err := drv.EventRecord(evs[count], g.s); err != nil {
		return tm, 0, err
	}
	for _, s := range b.s {
		if err := drv.StreamWaitEvent(s, evs[2], 0); err != nil {
			return tm, 0, err
		}
	}
	at := func(e cuda.Event) (float64, error) {
		ms, err := drv.EventElapsedTime(evs[0], e)
		return float64(ms), err
	}
	times := make([]float64, 0, reps)
	subs := make([]time.Duration, 0, reps)
	windows := make([][2]float64, 0, reps)
	tm.held = hold > 0
	for range reps {
		r, err := b.measure(enqueue, hold)
		var lo, hi float64
		if err == nil {
			lo, err = at(b.ev[0])
		}
		if err == nil {
			hi, err = at(b.ev[2])
		}
		if err != nil {
			return tm, 0, errors.Join(err, drv.StreamSynchronize(g.s))
		}
		times = append(times, r.ms)
		subs = append(subs, r.submit)
		windows = append(windows, [2]float64{lo, hi})
		tm.held = tm.held && r.held
	}
	if err := drv.StreamSynchronize(g.s); err != nil {
		return tm, 0, err
	}
	marks := make([]float64, count+1)
	for i, e := range evs {
		if marks[i], err = at(e); err != nil {
			return tm, 0, err
		}
	}
	var inside, overlap []float64
	for i := range count {
		d := marks[i+1] - marks[i]
		for _, w := range windows {
			if marks[i] >= w[0] && marks[i+1] <= w[1] {
				inside = append(inside, d)
				break
			}
			if marks[i+1] > w[0] && marks[i] < w[1] {
				overlap = append(overlap, d)
				break
			}
		}
	}
	if len(inside) == 0 {
		inside = overlap
	}
	if len(inside) > 0 {
		var sum float64
		for _, d := range inside {
			sum += d
		}
		slowPct = 100 * (sum/float64(len(inside))/soloMs - 1)
	}
	slices.Sort(times)
	slices.Sort(subs)
	tm.best, tm.median, tm.submit = times[0], times[len(times)/2], subs[len(subs)/2]
	return tm, slowPct, nil
}

// WriteThroughputCSV writes one line per row: method, ctas, dir, seg_bytes,
// gbps (gated GPU rate), pct_of_link, then median_gbps, background,
// pct_of_solo, sgemm_slowdown_pct, chosen, gated, pipelined_gbps,
// submit_ns_per_seg.
func WriteThroughputCSV(w io.Writer, r ThroughputResults) error {
	cw := csv.NewWriter(w)
	_ = cw.Write([]string{"method", "ctas", "dir", "seg_bytes", "gbps", "pct_of_link", "median_gbps", "background", "pct_of_solo", "sgemm_slowdown_pct", "chosen", "gated", "pipelined_gbps", "submit_ns_per_seg"})
	f := func(v float64) string { return strconv.FormatFloat(v, 'f', 2, 64) }
	for _, row := range r.Rows {
		_ = cw.Write([]string{row.Method, strconv.Itoa(row.CTAs), row.Dir, strconv.FormatUint(row.SegBytes, 10), f(row.GBps), f(row.PctOfLink), f(row.MedianGBps), row.Background, f(row.PctOfSolo), f(row.SGEMMSlowdownPct), row.Chosen, strconv.FormatBool(row.Gated), f(row.PipelinedGBps), f(row.SubmitNsPerSeg)})
	}
	cw.Flush()
	return cw.Error()
}

// FormatThroughput renders the results as markdown: the link reference,
// one table per direction (segment sizes × variants, GB/s and % of the
// link), the burn table, and the targets checked against the run.
func FormatThroughput(r ThroughputResults) string {
	var b strings.Builder
	fmt.Fprintf(&b, "# Transfer throughput: %s (driver %d)\n\n", r.Device, r.DriverVersion)
	if r.Config.Command != "" {
		fmt.Fprintf(&b, "Command: `%s`\n\n", r.Config.Command)
	}
	fmt.Fprintf(&b, "%s per direction per run, best of %d (median in the CSV), CUDA events; kernel %d threads/CTA; batch API: %v.\n\n",
		cudacopy.FormatBytes(r.Config.TotalBytes), r.Config.Reps, r.Config.Threads, r.Capabilities.Batch)
	fmt.Fprintf(&b, "Link (contiguous, pinned): d2h %.1f GB/s, h2d %.1f GB/s, both %.1f GB/s.", r.Link["d2h"], r.Link["h2d"], r.Link["both"])
	if r.LinkBefore != nil && r.LinkAfter != nil {
		fmt.Fprintf(&b, " The best of before the rows (d2h %.1f, h2d %.1f, both %.1f) and after them (d2h %.1f, h2d %.1f, both %.1f), each after a warm-up of %v, best of %d.",
			r.LinkBefore["d2h"], r.LinkBefore["h2d"], r.LinkBefore["both"], r.LinkAfter["d2h"], r.LinkAfter["h2d"], r.LinkAfter["both"], linkWarm, max(r.Config.Reps, linkReps))
	}
	b.WriteString("\n\n")
	b.WriteString(formatInvalid(r.Invalid))
	b.WriteString("GPU rate (the first table per direction): each run enqueued while the streams wait behind a spin kernel sized at twice the measured submit time, then timed with events, so the time is the copies', not the CPU's building them; † marks points where the gate did not hold or none ran (submission over " + maxGate.String() + "/2: the rate includes the CPU time, which is that method's limit). Pipelined: the same bytes as " + strconv.Itoa(pipeParts) + " back-to-back Submits per direction, ungated, as a serving engine overlaps them (where no gate ran, the ungated run itself: the same driver calls). Points whose warm-up took over " + strconv.Itoa(slowRunMs) + " ms get " + strconv.Itoa(slowReps) + " timed runs. CPU: median wall time of Submit per segment.\n\n")

	var variants []string
	cell := map[string]ThroughputRow{}
	for _, row := range r.Rows {
		if row.Background != "none" || row.Method == "contiguous" {
			continue
		}
		if !slices.Contains(variants, row.variant()) {
			variants = append(variants, row.variant())
		}
		cell[row.variant()+"/"+row.Dir+"/"+strconv.FormatUint(row.SegBytes, 10)] = row
	}
	header := func(title string) {
		fmt.Fprintf(&b, "%s\n\n| segment |", title)
		for _, v := range variants {
			fmt.Fprintf(&b, " %s |", v)
		}
		b.WriteString("\n|---|")
		for range variants {
			b.WriteString("---|")
		}
		b.WriteString("\n")
	}
	table := func(dir string, format func(row ThroughputRow) string) {
		for _, size := range r.Config.SegSizes {
			fmt.Fprintf(&b, "| %s |", cudacopy.FormatBytes(size))
			for _, v := range variants {
				row, ok := cell[v+"/"+dir+"/"+strconv.FormatUint(size, 10)]
				if !ok {
					b.WriteString(" – |")
					continue
				}
				fmt.Fprintf(&b, " %s |", format(row))
			}
			b.WriteString("\n")
		}
		b.WriteString("\n")
	}
	for _, dir := range []string{"d2h", "h2d", "both"} {
		header(fmt.Sprintf("## %s: GPU rate, gated (GB/s, %% of link)", dir))
		table(dir, func(row ThroughputRow) string {
			s := fmt.Sprintf("%.1f (%.0f%%)", row.GBps, row.PctOfLink)
			if !row.Gated {
				s += "†"
			}
			if row.Chosen != "" {
				s += " " + row.Chosen
			}
			return s
		})
		header(fmt.Sprintf("### %s: pipelined GB/s · CPU submit ns per segment", dir))
		table(dir, func(row ThroughputRow) string {
			return fmt.Sprintf("%.1f · %.0f ns", row.PipelinedGBps, row.SubmitNsPerSeg)
		})
	}

	b.WriteString("## Beside a matrix product\n\n")
	if r.SGEMM.Skipped != "" {
		fmt.Fprintf(&b, "Skipped: %s\n\n", r.SGEMM.Skipped)
	} else {
		fmt.Fprintf(&b, "kvo_sgemm n=%d alone: %.2f ms (%.1f TFLOPS).\n\n| variant | dir | segment | GB/s | %% of solo | sgemm slowdown |\n|---|---|---|---|---|---|\n", r.SGEMM.N, r.SGEMM.SoloMs, r.SGEMM.TFLOPS)
		for _, row := range r.Rows {
			if row.Background == "sgemm" {
				fmt.Fprintf(&b, "| %s | %s | %s | %.1f | %.0f%% | %+.1f%% |\n", row.variant(), row.Dir, cudacopy.FormatBytes(row.SegBytes), row.GBps, row.PctOfSolo, row.SGEMMSlowdownPct)
			}
		}
		b.WriteString("\n")
	}
	if len(r.Invalid) > 0 {
		b.WriteString("## Targets\n\nNot reported: the run is INVALID (see above).\n")
	} else {
		b.WriteString(formatTargets(r, cell, variants))
	}
	if r.Calibration != nil {
		fmt.Fprintf(&b, "\n## Calibration used by auto (kernel D2H %v, H2D %v; %s per point)\n\n%s", r.Calibration.D2H, r.Calibration.H2D, cudacopy.FormatBytes(r.Calibration.TotalBytes), r.Calibration.Markdown())
	}
	return b.String()
}

// formatInvalid renders LinkVerdict's lines as the INVALID notice, or
// nothing for a valid run.
func formatInvalid(bad []string) string {
	if len(bad) == 0 {
		return ""
	}
	var b strings.Builder
	fmt.Fprintf(&b, "**INVALID**: %d row(s) above %d%% of the link; the link reference or those rows are wrong, and no target is reported:\n\n", len(bad), MaxPctOfLink)
	for _, l := range bad {
		fmt.Fprintf(&b, "- %s\n", l)
	}
	b.WriteString("\n")
	return b.String()
}

// formatTargets checks issue 5's targets against the run.
func formatTargets(r ThroughputResults, cell map[string]ThroughputRow, variants []string) string {
	var b strings.Builder
	b.WriteString("## Targets\n\n")
	mark := func(ok bool) string {
		if ok {
			return "met"
		}
		return "MISSED"
	}
	for _, dir := range []string{"d2h", "h2d", "both"} {
		need := map[string]float64{"d2h": 92, "h2d": 90, "both": 90}[dir]
		for _, size := range r.Config.SegSizes {
			k := "/" + dir + "/" + strconv.FormatUint(size, 10)
			auto, ok := cell["auto"+k]
			if !ok {
				continue
			}
			var best ThroughputRow
			for _, v := range variants {
				if row := cell[v+k]; row.GBps > best.GBps {
					best = row
				}
			}
			pctBest := 100 * auto.GBps / best.GBps
			fmt.Fprintf(&b, "- %s %s: auto %.1f GB/s = %.1f%% of best (%s) [≥97%%: %s], %.1f%% of link [≥%.0f%%: %s]\n",
				dir, cudacopy.FormatBytes(size), auto.GBps, pctBest, best.variant(), mark(pctBest >= 97), auto.PctOfLink, need, mark(auto.PctOfLink >= need))
		}
	}
	for _, row := range r.Rows {
		if row.Background == "sgemm" && row.Method == "auto" {
			fmt.Fprintf(&b, "- beside sgemm, auto %s %s: %.0f%% of solo [≥80%%: %s], sgemm slowed %.1f%% [≤10%%: %s]\n",
				row.Dir, cudacopy.FormatBytes(row.SegBytes), row.PctOfSolo, mark(row.PctOfSolo >= 80), row.SGEMMSlowdownPct, mark(row.SGEMMSlowdownPct <= 10))
		}
	}
	return b.String()
}

// KernelVariant is one copy-kernel launch configuration of the sweep.
type KernelVariant struct {
	Threads int `json:"threads"`
	CTAs    int `json:"ctas"`
	// HighPriority puts the transfer streams at the device's greatest
	// priority (else the least, where the matrix product also runs).
	HighPriority bool `json:"high_priority"`
	// CopyKernel is one of cudacopy's copy kernels (DefaultCopyKernel etc.).
	CopyKernel string `json:"copy_kernel"`
	// FenceBytes and PaceGBps are cudacopy.Options' (throttled kernels
	// only).
	FenceBytes int     `json:"fence_bytes,omitempty"`
	PaceGBps   float64 `json:"pace_gbps,omitempty"`
	// Method is the D2H side's method (zero: MethodKernel); a DMA method
	// leaves the launch fields unused.
	Method cudacopy.Method `json:"method,omitempty"`
	// H2DMethod, when set, is the H2D side's method, on a copier of its own
	// with the default launches, or H2DCTAs × H2DThreads for MethodKernel
	// (zero: the same copier as D2H).
	H2DMethod cudacopy.Method `json:"h2d_method,omitempty"`
	// Streams spreads each DMA side of a run over this many streams
	// (zero or one: the bench's own stream per direction).
	Streams int `json:"streams,omitempty"`
	// H2DCTAs and H2DThreads, when set, are the H2D copier's grid with
	// H2DMethod MethodKernel, each zero field the default launch's; with
	// another H2DMethod the variant is skipped.
	H2DCTAs    int `json:"h2d_ctas,omitempty"`
	H2DThreads int `json:"h2d_threads,omitempty"`
}

func (v KernelVariant) method() cudacopy.Method {
	if v.Method == cudacopy.MethodAuto {
		return cudacopy.MethodKernel
	}
	return v.Method
}

// kernelLabel is the variant's kernel, with its fence interval and pace if
// any; for a DMA method, the method and its streams; then the H2D side's
// method if it has its own.
func (v KernelVariant) kernelLabel() string {
	streams := ""
	if v.Streams > 1 {
		streams = fmt.Sprintf(" ×%d streams", v.Streams)
	}
	l := v.kernelOnlyLabel()
	if m := v.method(); m != cudacopy.MethodKernel {
		l = m.String() + streams
	}
	if m := v.H2DMethod; m != cudacopy.MethodAuto {
		l += " · h2d " + m.String()
		if m != cudacopy.MethodKernel {
			l += streams
		} else if v.H2DCTAs != 0 || v.H2DThreads != 0 {
			d := cudacopy.DefaultLaunch(cudacopy.H2D, false)
			l += fmt.Sprintf(" %d×%d", cmp.Or(v.H2DCTAs, d.CTAs), cmp.Or(v.H2DThreads, d.Threads))
		}
	}
	return l
}

func (v KernelVariant) kernelOnlyLabel() string {
	l := v.CopyKernel
	if v.FenceBytes > 0 {
		l += "/" + cudacopy.FormatBytes(uint64(v.FenceBytes))
	}
	if v.PaceGBps > 0 {
		l += fmt.Sprintf(" @%g GB/s", v.PaceGBps)
	}
	return l
}

func (v KernelVariant) String() string {
	p := "normal"
	if v.HighPriority {
		p = "high"
	}
	return fmt.Sprintf("%s %d×%d %s", v.kernelLabel(), v.CTAs, v.Threads, p)
}

// FenceKernelVariants measures kvo_copy_sys's fence (every 4 to 12 KiB
// per warp, which bounds each warp's host stores in flight) and kvo_copy
// over launch shapes of 32 to 128 warps on at most 8 CTAs. Pacing
// (PaceGBps) is left out: on the H200 it did not lower the matrix
// product's slowdown at a given D2H rate
// (git show 5fe4e35:bench/results/2026-11-30-h200/fence-sweep-2.md).
func FenceKernelVariants() []KernelVariant {
	sys := func(threads, ctas, fence int) KernelVariant {
		return KernelVariant{Threads: threads, CTAs: ctas, HighPriority: true, CopyKernel: cudacopy.SysFenceCopyKernel, FenceBytes: fence * cudacopy.FenceUnit}
	}
	plain := func(threads, ctas int) KernelVariant {
		return KernelVariant{Threads: threads, CTAs: ctas, HighPriority: true, CopyKernel: cudacopy.DefaultCopyKernel}
	}
	return []KernelVariant{
		plain(256, 4), plain(256, 8), plain(512, 4), plain(512, 6), plain(512, 8), plain(1024, 4),
		sys(256, 4, 3), sys(256, 8, 2), sys(256, 8, 3),
		sys(512, 4, 1), sys(512, 4, 2), sys(512, 4, 3),
		sys(512, 8, 1), sys(512, 8, 2), sys(1024, 4, 1), sys(1024, 4, 2),
	}
}

// ProbeKernelVariants measures kvo_copy_probe (each warp reads back a word
// it stored every 4 KiB, in place of kvo_copy_sys's fence) on 48 to 64
// warps, beside kvo_copy_sys's launch before it; the list that picked the
// default D2H launch (bench/results/h200/sweep-probe/, scripts/gpu/run.sh sweep:probe).
func ProbeKernelVariants() []KernelVariant {
	v := func(kernel string, threads, ctas, fence int) KernelVariant {
		return KernelVariant{Threads: threads, CTAs: ctas, HighPriority: true, CopyKernel: kernel, FenceBytes: fence * cudacopy.FenceUnit}
	}
	p := cudacopy.ProbeCopyKernel
	return []KernelVariant{
		v(cudacopy.SysFenceCopyKernel, 512, 4, 1),
		v(p, 256, 6, 1), v(p, 192, 8, 1), v(p, 256, 7, 1), v(p, 384, 4, 1), v(p, 320, 6, 1), v(p, 256, 8, 1), v(p, 256, 6, 1),
	}
}

// ProbeGridVariants measures kvo_copy_probe's D2H grid from 48 to 64 warps
// (the default 8 × 192 twice, for the run-to-run spread) with H2D on its
// own copier at the default launch, so that both directions at once run
// as the engine runs them.
func ProbeGridVariants() []KernelVariant {
	v := func(threads, ctas int) KernelVariant {
		return KernelVariant{Threads: threads, CTAs: ctas, HighPriority: true, CopyKernel: cudacopy.ProbeCopyKernel, FenceBytes: cudacopy.FenceUnit, H2DMethod: cudacopy.MethodKernel}
	}
	return []KernelVariant{v(192, 8), v(224, 8), v(256, 7), v(256, 8), v(192, 8)}
}

// BidirKernelVariants measures both directions at once on kernel
// launches: the D2H read-back's interval (4 to 16 KiB) and grid against
// the H2D grid (the default 4 × 512 up to 8 × 1024, more host reads in
// flight), with the unthrottled kvo_copy both ways for reference.
func BidirKernelVariants() []KernelVariant {
	v := func(kernel string, threads, ctas, fence, h2dCTAs, h2dThreads int) KernelVariant {
		return KernelVariant{Threads: threads, CTAs: ctas, HighPriority: true, CopyKernel: kernel, FenceBytes: fence * cudacopy.FenceUnit,
			H2DMethod: cudacopy.MethodKernel, H2DCTAs: h2dCTAs, H2DThreads: h2dThreads}
	}
	p := cudacopy.ProbeCopyKernel
	return []KernelVariant{
		v(p, 192, 8, 1, 0, 0), v(p, 192, 8, 1, 8, 512), v(p, 192, 8, 1, 8, 1024),
		v(p, 192, 8, 2, 0, 0), v(p, 192, 8, 2, 8, 1024), v(p, 192, 8, 4, 0, 0),
		v(p, 256, 8, 1, 8, 1024), v(cudacopy.DefaultCopyKernel, 1024, 8, 0, 8, 1024),
	}
}

// BatchKernelVariants measures the batch API spread over 1 to 8 streams
// per direction (several copy engines at once), and, both ways at once,
// the default kernel launches on one side with the batch API on the other.
func BatchKernelVariants() []KernelVariant {
	v := func(m, h2d cudacopy.Method, streams int) KernelVariant {
		return KernelVariant{Threads: 512, CTAs: 4, HighPriority: true, CopyKernel: cudacopy.SysFenceCopyKernel, FenceBytes: cudacopy.FenceUnit, Method: m, H2DMethod: h2d, Streams: streams}
	}
	b, k := cudacopy.MethodBatch, cudacopy.MethodKernel
	return []KernelVariant{
		v(b, 0, 1), v(b, 0, 2), v(b, 0, 4), v(b, 0, 8),
		v(k, b, 4), v(b, k, 4),
	}
}

// DefaultKernelVariants crosses both copy kernels and both priorities with
// threads per CTA × CTAs: the launch of ANCHORS.md (8 × 1024), fewer warps
// (down to 2 × 256, which trades rate for less interference with compute),
// and the same 256 warps spread over more, smaller CTAs.
func DefaultKernelVariants() []KernelVariant {
	shapes := [][2]int{{1024, 8}, {1024, 4}, {512, 8}, {512, 16}, {256, 2}, {256, 4}, {256, 8}, {256, 16}, {256, 32}, {128, 32}, {128, 64}}
	var vs []KernelVariant
	for _, k := range []string{cudacopy.DefaultCopyKernel, cudacopy.StreamingCopyKernel} {
		for _, high := range []bool{true, false} {
			for _, sh := range shapes {
				vs = append(vs, KernelVariant{Threads: sh[0], CTAs: sh[1], HighPriority: high, CopyKernel: k})
			}
		}
	}
	return vs
}

// KernelSweepConfig says what MeasureKernelVariants measures.
type KernelSweepConfig struct {
	// TotalBytes per direction per run (default 256 MiB).
	TotalBytes uint64
	// SegSizes measured solo (default 4 KiB and 64 KiB); the last one is
	// also measured beside the matrix product.
	SegSizes []uint64
	// BurnN is kvo_sgemm's matrix size (default 2048).
	BurnN int
	// Reps timed per point (default 3).
	Reps     int
	Variants []KernelVariant
	// Dirs measured solo (default "d2h", "h2d"; "both" is both at once).
	Dirs []string
	// BesideAll measures every segment size beside the matrix product, not
	// just the last.
	BesideAll bool
	// PTX replaces the embedded kernels.ptx.
	PTX  []byte
	Seed uint64
}

// KernelVariantResult is one variant's figures. Keys are "d2h/4096" etc.
type KernelVariantResult struct {
	Variant KernelVariant `json:"variant"`
	// Skipped says why the variant did not run (kernel absent from the PTX,
	// more CTAs than SMs).
	Skipped string `json:"skipped,omitempty"`
	// Solo is GB/s alone (gated: the GPU rate, see ThroughputRow.GBps);
	// Pipelined the same bytes as pipeParts ungated Submits; SubmitNsPerSeg
	// the CPU cost of Submit per segment; Gated whether every solo run's
	// gate held. Beside is GB/s beside kvo_sgemm (gated) and SlowPct the
	// sgemm's slowdown then.
	Solo map[string]float64 `json:"solo_gbps"`
	// BothSides is, for each "both" point of Solo, each direction's GB/s
	// over its own stream's end ([0] D2H, [1] H2D) in the same run.
	BothSides      map[string][2]float64 `json:"both_sides_gbps,omitempty"`
	Pipelined      map[string]float64    `json:"pipelined_gbps"`
	SubmitNsPerSeg map[string]float64    `json:"submit_ns_per_seg"`
	Gated          bool                  `json:"gated"`
	Beside         map[string]float64    `json:"beside_gbps"`
	SlowPct        map[string]float64    `json:"sgemm_slowdown_pct"`
}

// KernelSweepResults is the whole sweep.
type KernelSweepResults struct {
	Link     map[string]float64 `json:"link_gbps"`
	SGEMM    SGEMMInfo          `json:"sgemm"`
	SegSizes []uint64           `json:"seg_sizes"`
	// Dirs and BesideSizes are what was measured solo and beside the
	// matrix product (empty: "d2h", "h2d" and the last size).
	Dirs        []string              `json:"dirs,omitempty"`
	BesideSizes []uint64              `json:"beside_sizes,omitempty"`
	Rows        []KernelVariantResult `json:"rows"`
}

// dirs and besideSizes apply the defaults of Dirs and BesideSizes.
func (r KernelSweepResults) dirs() []string {
	if len(r.Dirs) == 0 {
		return []string{"d2h", "h2d"}
	}
	return r.Dirs
}

func (r KernelSweepResults) besideSizes() []uint64 {
	if len(r.BesideSizes) == 0 && len(r.SegSizes) > 0 {
		return r.SegSizes[len(r.SegSizes)-1:]
	}
	return r.BesideSizes
}

// MeasureKernelVariants measures each copy-kernel variant solo at every
// segment size each way, then at the last size beside kvo_sgemm on a
// least-priority stream, against the contiguous link measured in the same
// call. The calling goroutine must be locked to an OS thread with dev's
// context current.
func MeasureKernelVariants(drv cuda.Driver, dev cuda.Device, cfg KernelSweepConfig) (res KernelSweepResults, err error) {
	if cfg.TotalBytes == 0 {
		cfg.TotalBytes = 256 << 20
	}
	if len(cfg.SegSizes) == 0 {
		cfg.SegSizes = []uint64{4 << 10, 64 << 10}
	}
	if cfg.BurnN == 0 {
		cfg.BurnN = 2048
	}
	if cfg.Reps == 0 {
		cfg.Reps = 3
	}
	if len(cfg.Variants) == 0 {
		cfg.Variants = DefaultKernelVariants()
	}
	if len(cfg.Dirs) == 0 {
		cfg.Dirs = []string{"d2h", "h2d"}
	}
	for _, d := range cfg.Dirs {
		if d != "d2h" && d != "h2d" && d != "both" {
			return res, fmt.Errorf("bench: sweep direction %q is not d2h, h2d or both", d)
		}
	}
	tc := ThroughputConfig{TotalBytes: cfg.TotalBytes, SegSizes: cfg.SegSizes, Reps: cfg.Reps, BurnN: cfg.BurnN, Seed: cfg.Seed, PTX: cfg.PTX, CTAs: []int{1}}.withDefaults()
	if err := tc.validate(); err != nil {
		return res, err
	}
	res.SegSizes = cfg.SegSizes
	res.Dirs = cfg.Dirs
	res.BesideSizes = cfg.SegSizes[len(cfg.SegSizes)-1:]
	if cfg.BesideAll {
		res.BesideSizes = cfg.SegSizes
	}
	b := &bench{drv: drv, cfg: tc}
	defer func() { err = errors.Join(err, b.close()) }()
	if err := b.setupBase(); err != nil {
		return res, err
	}
	least, _, err := drv.StreamPriorityRange()
	if err != nil {
		return res, err
	}
	high := b.s
	normal, err := b.streamPair(least)
	if err != nil {
		return res, err
	}
	tr := ThroughputResults{Link: map[string]float64{}}
	if err := b.link(&tr); err != nil {
		return res, err
	}
	res.Link = tr.Link
	g, info, err := b.soloGemm()
	res.SGEMM = info
	if err != nil {
		return res, err
	}
	segs := map[uint64]segSet{}
	for _, size := range cfg.SegSizes {
		segs[size] = b.segments(size)
	}
	for _, kv := range cfg.Variants {
		row := KernelVariantResult{Variant: kv, Solo: map[string]float64{}, Pipelined: map[string]float64{}, SubmitNsPerSeg: map[string]float64{}, Beside: map[string]float64{}, SlowPct: map[string]float64{}}
		if kv.Streams > 1 && !kv.HighPriority {
			// The fan's streams are made at the greatest priority.
			row.Skipped = "Streams needs HighPriority"
			res.Rows = append(res.Rows, row)
			continue
		}
		v, err := b.sweepVariant(dev, kv)
		if err != nil {
			if errors.Is(err, cudacopy.ErrUnavailable) || errors.Is(err, cudacopy.ErrInvalidOption) {
				row.Skipped = err.Error()
				res.Rows = append(res.Rows, row)
				continue
			}
			return res, err
		}
		b.s = normal
		if kv.HighPriority {
			b.s = high
		}
		err = b.sweepOne(&row, v, g, res.SGEMM.SoloMs, segs, res.Dirs, res.BesideSizes)
		if err = errors.Join(err, v.close()); err != nil {
			return res, fmt.Errorf("bench: variant %s: %w", kv, err)
		}
		res.Rows = append(res.Rows, row)
	}
	b.s = high
	return res, nil
}

// sweepVariant makes kv's copiers (and its fan of streams, at the
// greatest priority).
func (b *bench) sweepVariant(dev cuda.Device, kv KernelVariant) (*variant, error) {
	if (kv.H2DCTAs != 0 || kv.H2DThreads != 0) && kv.H2DMethod != cudacopy.MethodKernel {
		return nil, fmt.Errorf("%w: H2DCTAs %d and H2DThreads %d need H2DMethod kernel, not %v", cudacopy.ErrInvalidOption, kv.H2DCTAs, kv.H2DThreads, kv.H2DMethod)
	}
	o := cudacopy.Options{Method: kv.method()}
	if o.Method == cudacopy.MethodKernel {
		o.CTAs, o.Threads, o.CopyKernel, o.FenceBytes, o.PaceGBps = kv.CTAs, kv.Threads, kv.CopyKernel, kv.FenceBytes, kv.PaceGBps
	}
	c, err := b.newCopier(dev, o)
	if err != nil {
		return nil, err
	}
	v := &variant{name: kv.String(), method: o.Method, ctas: kv.CTAs, c: c}
	if kv.H2DMethod != cudacopy.MethodAuto {
		o := cudacopy.Options{Method: kv.H2DMethod}
		if o.Method == cudacopy.MethodKernel {
			o.CTAs, o.Threads = kv.H2DCTAs, kv.H2DThreads
		}
		if v.h2d, err = b.newCopier(dev, o); err != nil {
			return nil, errors.Join(err, c.Close())
		}
	}
	if kv.Streams > 1 {
		_, greatest, err := b.drv.StreamPriorityRange()
		if err == nil {
			v.fan, err = b.newFan(kv.Streams, greatest)
		}
		if err != nil {
			return nil, errors.Join(err, v.close())
		}
	}
	return v, nil
}

func (b *bench) sweepOne(row *KernelVariantResult, v *variant, g *gemm, soloMs float64, segs map[uint64]segSet, dirs []string, besideSizes []uint64) error {
	solo := map[string]timing{}
	row.Gated = b.gate != nil
	// bytes and segments moved by one run in dir ("both" moves each
	// direction's).
	per := func(dir string) uint64 {
		if dir == "both" {
			return 2
		}
		return 1
	}
	for _, size := range b.cfg.SegSizes {
		for _, dir := range dirs {
			key := dir + "/" + strconv.FormatUint(size, 10)
			tm, err := b.reps(b.enqueueFor(v, dir, segs[size]), true)
			if err != nil {
				return err
			}
			pipe, err := b.reps(b.pipelinedFor(v, dir, segs[size]), false)
			if err != nil {
				return err
			}
			row.Solo[key] = gbps(per(dir)*b.cfg.TotalBytes, tm.best)
			if dir == "both" {
				if row.BothSides == nil {
					row.BothSides = map[string][2]float64{}
				}
				row.BothSides[key] = [2]float64{gbps(b.cfg.TotalBytes, tm.bestSides[0]), gbps(b.cfg.TotalBytes, tm.bestSides[1])}
			}
			row.Pipelined[key] = gbps(per(dir)*b.cfg.TotalBytes, pipe.best)
			row.SubmitNsPerSeg[key] = float64(tm.submit.Nanoseconds()) / float64(per(dir)*uint64(len(segs[size].d2h)))
			solo[key] = tm
			row.Gated = row.Gated && tm.held
		}
	}
	if g == nil {
		return nil
	}
	for _, size := range besideSizes {
		for _, dir := range dirs {
			key := dir + "/" + strconv.FormatUint(size, 10)
			tm, slow, err := b.besideGemm(g, soloMs, solo[key], b.enqueueFor(v, dir, segs[size]))
			if err != nil {
				return err
			}
			row.Beside[key] = gbps(per(dir)*b.cfg.TotalBytes, tm.best)
			row.SlowPct[key] = slow
		}
	}
	return nil
}

// SweepSlowdownLimit is issue 5's bound on the matrix product's slowdown.
const SweepSlowdownLimit = 10.0

// Pick returns the variant with the highest worst-case solo rate (as a
// fraction of the link, over every measured point) among those whose
// every sgemm slowdown is within SweepSlowdownLimit, and whether one
// qualified; with none, the one with the least worst slowdown.
func (r KernelSweepResults) Pick() (KernelVariantResult, bool) {
	var best KernelVariantResult
	bestScore, found := -1.0, false
	leastSlow, leastIdx := math.Inf(1), -1
	for i, row := range r.Rows {
		if row.Skipped != "" || len(row.Solo) == 0 {
			continue
		}
		worst := math.Inf(1)
		for k, v := range row.Solo {
			dir, _, _ := strings.Cut(k, "/")
			if l := r.Link[dir]; l > 0 {
				worst = min(worst, v/l)
			}
		}
		slow := math.Inf(-1)
		for _, s := range row.SlowPct {
			slow = max(slow, s)
		}
		if len(row.SlowPct) == 0 {
			slow = 0
		}
		if slow < leastSlow {
			leastSlow, leastIdx = slow, i
		}
		if slow <= SweepSlowdownLimit && worst > bestScore {
			best, bestScore, found = row, worst, true
		}
	}
	if !found && leastIdx >= 0 {
		best = r.Rows[leastIdx]
	}
	return best, found
}

// FormatKernelSweep renders the sweep as one markdown table (GB/s and % of
// the link per point, rates and sgemm slowdown beside the matrix product)
// and the variant Pick recommends.
func FormatKernelSweep(r KernelSweepResults) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Link: d2h %.1f GB/s, h2d %.1f GB/s", r.Link["d2h"], r.Link["h2d"])
	if l, ok := r.Link["both"]; ok {
		fmt.Fprintf(&b, ", both %.1f GB/s", l)
	}
	b.WriteString(". ")
	if r.SGEMM.Skipped != "" {
		fmt.Fprintf(&b, "sgemm skipped: %s\n\n", r.SGEMM.Skipped)
	} else {
		fmt.Fprintf(&b, "kvo_sgemm n=%d alone: %.2f ms (%.1f TFLOPS).\n\n", r.SGEMM.N, r.SGEMM.SoloMs, r.SGEMM.TFLOPS)
	}
	var solo, beside []string
	for _, size := range r.SegSizes {
		for _, dir := range r.dirs() {
			solo = append(solo, dir+"/"+strconv.FormatUint(size, 10))
		}
	}
	for _, size := range r.besideSizes() {
		for _, dir := range r.dirs() {
			beside = append(beside, dir+"/"+strconv.FormatUint(size, 10))
		}
	}
	label := func(k string) string {
		dir, size, _ := strings.Cut(k, "/")
		n, _ := strconv.ParseUint(size, 10, 64)
		return dir + " " + cudacopy.FormatBytes(n)
	}
	b.WriteString("GPU rates gated (a spin kernel holds the streams while the CPU enqueues; † where it did not hold); pipelined: " + strconv.Itoa(pipeParts) + " ungated Submits; ns/seg: CPU cost of Submit per segment; both (d2h · h2d): each direction's bytes over the time its own stream ended.\n\n")
	b.WriteString("| kernel | CTAs×threads | warps | priority |")
	for _, k := range solo {
		fmt.Fprintf(&b, " %s |", label(k))
	}
	for _, k := range solo {
		fmt.Fprintf(&b, " %s pipelined · ns/seg |", label(k))
	}
	for _, k := range beside {
		fmt.Fprintf(&b, " %s beside sgemm | sgemm slowdown |", label(k))
	}
	b.WriteString("\n|---|---|---:|---|")
	b.WriteString(strings.Repeat("---:|", 2*len(solo)+2*len(beside)))
	b.WriteString("\n")
	for _, row := range r.Rows {
		v := row.Variant
		p := "normal"
		if v.HighPriority {
			p = "high"
		}
		if v.method() == cudacopy.MethodKernel {
			fmt.Fprintf(&b, "| %s | %d×%d | %d | %s |", v.kernelLabel(), v.CTAs, v.Threads, v.CTAs*v.Threads/32, p)
		} else {
			fmt.Fprintf(&b, "| %s | – | – | %s |", v.kernelLabel(), p)
		}
		if row.Skipped != "" {
			fmt.Fprintf(&b, " skipped: %s |\n", row.Skipped)
			continue
		}
		mark := ""
		if !row.Gated {
			mark = "†"
		}
		for _, k := range solo {
			dir, _, _ := strings.Cut(k, "/")
			fmt.Fprintf(&b, " %.1f (%.0f%%)%s", row.Solo[k], 100*row.Solo[k]/max(r.Link[dir], 1e-9), mark)
			if sd, ok := row.BothSides[k]; ok {
				fmt.Fprintf(&b, " (d2h %.1f · h2d %.1f)", sd[0], sd[1])
			}
			b.WriteString(" |")
		}
		for _, k := range solo {
			fmt.Fprintf(&b, " %.1f · %.0f |", row.Pipelined[k], row.SubmitNsPerSeg[k])
		}
		for _, k := range beside {
			if s, ok := row.SlowPct[k]; ok {
				fmt.Fprintf(&b, " %.1f | %+.1f%% |", row.Beside[k], s)
			} else {
				b.WriteString(" – | – |")
			}
		}
		b.WriteString("\n")
	}
	if best, ok := r.Pick(); best.Variant.CopyKernel != "" {
		if ok {
			fmt.Fprintf(&b, "\nPick: %s (highest worst-case %% of link with sgemm slowdown ≤ %.0f%%).\n", best.Variant, SweepSlowdownLimit)
		} else {
			fmt.Fprintf(&b, "\nNo variant kept the sgemm slowdown ≤ %.0f%%; least slowdown: %s.\n", SweepSlowdownLimit, best.Variant)
		}
	}
	return b.String()
}
