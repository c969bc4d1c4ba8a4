package benchgpu

// The throughput benchmark of issue 5: ThroughputConfig, ThroughputRow,
// ThroughputResults, MeasureThroughput, and scattered, which measures one
// row. The bench it runs on is in setup.go, its timed runs in timing.go
// and gate.go, what a run submits in variant.go, and the CSV and markdown
// in throughput_report.go. No locks: a call runs on the one goroutine
// that has the device's context current.

import (
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
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
