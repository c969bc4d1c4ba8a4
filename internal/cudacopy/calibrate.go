package cudacopy

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

// CalibrationConfig says what Calibrate measures. Zero fields take defaults.
//
// Each point (direction, segment size, method) is timed as a serving engine
// sees it: an untimed lead Submit, then up to Pieces back-to-back Submits,
// timed with CUDA events from the completion of the lead to the completion
// of the last piece. The lead hides the first Submit's CPU cost, as earlier
// copies in flight do in the engine, so a method's CPU submit cost counts
// only where it is slower than the copies it enqueues (then the pieces wait
// for the CPU, and the rate is the CPU's).
type CalibrationConfig struct {
	// TotalBytes is the size of the pinned host buffer and the device
	// buffer whose random slots the segments use (default 32 MiB).
	TotalBytes uint64 `json:"total_bytes"`
	// SegSizes are the segment sizes measured (default 4, 16, 64, 256 KiB
	// and 2 MiB); each a multiple of 16 no larger than TotalBytes.
	SegSizes []uint64 `json:"seg_sizes"`
	// PieceBytes bounds the bytes of one Submit (default 16 MiB, or
	// TotalBytes if smaller; at most TotalBytes).
	PieceBytes uint64 `json:"piece_bytes"`
	// PieceSegs bounds the segments of one Submit (default 1024), so that
	// the methods that cost microseconds of CPU per segment stay cheap to
	// measure at small sizes.
	PieceSegs int `json:"piece_segs"`
	// Pieces is the most timed Submits per run (default 4).
	Pieces int `json:"pieces"`
	// Reps is the most runs per point; the best counts (default 2).
	Reps int `json:"reps"`
	// PointBudget bounds the wall time of one point (default 4 ms): a run
	// stops adding pieces, and a point stops adding runs, once it is spent
	// (one timed piece and one run always happen). The whole calibration
	// thus takes about the number of points times PointBudget: a fraction
	// of a second with the defaults.
	PointBudget time.Duration `json:"point_budget_ns"`
	// Seed of the random slot permutations.
	Seed uint64 `json:"seed"`
}

// DefaultSegSizes are the KV segment sizes the engine is tuned for.
var DefaultSegSizes = []uint64{4 << 10, 16 << 10, 64 << 10, 256 << 10, 2 << 20}

// Calibration defaults (see CalibrationConfig).
const (
	DefaultCalibrationBytes = 32 << 20
	DefaultPieceBytes       = 16 << 20
	DefaultPieceSegs        = 1024
	DefaultPieces           = 4
	DefaultCalibrationReps  = 2
	DefaultPointBudget      = 4 * time.Millisecond
)

func (c CalibrationConfig) withDefaults() CalibrationConfig {
	if c.TotalBytes == 0 {
		c.TotalBytes = DefaultCalibrationBytes
	}
	if len(c.SegSizes) == 0 {
		c.SegSizes = DefaultSegSizes
	}
	if c.PieceBytes == 0 {
		c.PieceBytes = min(DefaultPieceBytes, c.TotalBytes)
	}
	if c.PieceSegs == 0 {
		c.PieceSegs = DefaultPieceSegs
	}
	if c.Pieces == 0 {
		c.Pieces = DefaultPieces
	}
	if c.Reps == 0 {
		c.Reps = DefaultCalibrationReps
	}
	if c.PointBudget == 0 {
		c.PointBudget = DefaultPointBudget
	}
	return c
}

func (c CalibrationConfig) validate() error {
	switch {
	case c.Reps < 1:
		return fmt.Errorf("%w: calibration Reps %d is not positive", ErrInvalidOption, c.Reps)
	case c.Pieces < 1:
		return fmt.Errorf("%w: calibration Pieces %d is not positive", ErrInvalidOption, c.Pieces)
	case c.PieceSegs < 1:
		return fmt.Errorf("%w: calibration PieceSegs %d is not positive", ErrInvalidOption, c.PieceSegs)
	case c.PointBudget < 0:
		return fmt.Errorf("%w: calibration PointBudget %v is negative", ErrInvalidOption, c.PointBudget)
	case c.PieceBytes == 0 || c.PieceBytes > c.TotalBytes:
		return fmt.Errorf("%w: calibration PieceBytes %d not in (0, TotalBytes %d]", ErrInvalidOption, c.PieceBytes, c.TotalBytes)
	}
	for _, s := range c.SegSizes {
		if s == 0 || s%kernelAlign != 0 || s > c.TotalBytes {
			return fmt.Errorf("%w: calibration segment size %d is not a multiple of %d in (0, TotalBytes %d]", ErrInvalidOption, s, kernelAlign, c.TotalBytes)
		}
	}
	return nil
}

// pieces splits the segments of one size into the Submits of a run: as
// many as PieceBytes and PieceSegs allow per Submit (at least one segment).
func (c CalibrationConfig) pieces(segs []Segment, size uint64) [][]Segment {
	per := max(1, min(c.PieceSegs, int(c.PieceBytes/size)))
	var out [][]Segment
	for lo := 0; lo+per <= len(segs); lo += per {
		out = append(out, segs[lo:lo+per])
	}
	return out
}

// ScatteredSegments returns n segments of size bytes moving between slot
// ph[i] of the host side and slot pd[i] of the device side, where ph and pd
// are independent random permutations of [0, n): the "random slots on both
// sides" pattern of the benchmarks. dir says which side is the source.
func ScatteredSegments(dir Path, host, dev, size uint64, n int, rng *rand.Rand) []Segment {
	ph, pd := rng.Perm(n), rng.Perm(n)
	segs := make([]Segment, n)
	for i := range segs {
		h, d := host+uint64(ph[i])*size, dev+uint64(pd[i])*size
		if dir == H2D {
			segs[i] = Segment{Dst: d, Src: h, Len: size}
		} else {
			segs[i] = Segment{Dst: h, Src: d, Len: size}
		}
	}
	return segs
}

// Calibrate measures the pipelined rate (see CalibrationConfig) of every
// available method (memcpy, batch, the kernel at the configured CTAs) for
// each direction and segment size of Options.Calibrate on stream s, with
// segments at random slots of a pinned buffer and a device buffer it
// allocates and frees, installs the result as the table Choose uses, and
// returns it. Each method is warmed up once per direction (at the largest
// size, with a full run, so that first-launch costs and the descriptor
// buffers a pipeline needs are paid before timing). s must be otherwise
// idle; the call blocks until the measurements are done.
func (c *Copier) Calibrate(s cuda.Stream) (cal *Calibration, err error) {
	cfg := c.opts.Calibrate
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	hostP, err := c.drv.MemHostAlloc(cfg.TotalBytes, cuda.HostAllocPortable|cuda.HostAllocDeviceMap)
	if err != nil {
		return nil, fmt.Errorf("cudacopy: calibration host buffer of %d bytes: %w", cfg.TotalBytes, err)
	}
	defer func() { err = errors.Join(err, c.drv.MemFreeHost(hostP)) }()
	dev, err := c.allocRaw(cfg.TotalBytes, "calibration device buffer")
	if err != nil {
		return nil, err
	}
	defer func() {
		err = errors.Join(err, c.freeRaw(dev, cfg.TotalBytes))
	}()
	host := uintptr(hostP)
	if err := c.AddHostRange(host, cfg.TotalBytes); err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, c.RemoveHostRange(host)) }()
	var ev [2]cuda.Event
	for i := range ev {
		if ev[i], err = c.drv.EventCreate(cuda.EventDefault); err != nil {
			return nil, fmt.Errorf("cudacopy: calibration event: %w", err)
		}
		defer func(e cuda.Event) { err = errors.Join(err, c.drv.EventDestroy(e)) }(ev[i])
	}

	methods := []Method{MethodMemcpy}
	if c.caps.Batch {
		methods = append(methods, MethodBatch)
	}
	if c.caps.Kernel {
		methods = append(methods, MethodKernel)
	}
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x6b766f))
	out := &Calibration{D2H: c.d2h.Launch, H2D: c.h2d.Launch, TotalBytes: cfg.TotalBytes, PieceBytes: cfg.PieceBytes, Pieces: cfg.Pieces}
	largest := slices.Max(cfg.SegSizes)
	for _, dir := range [...]Path{D2H, H2D} {
		warm := cfg.pieces(ScatteredSegments(dir, uint64(host), uint64(dev), largest, int(cfg.TotalBytes/largest), rng), largest)
		for _, m := range methods {
			if _, err := c.timePipeline(s, ev, dir, warm, m, cfg.Pieces, 0); err != nil {
				return nil, fmt.Errorf("cudacopy: calibration warm-up of %s %s: %w", m, dir, err)
			}
		}
		for _, size := range cfg.SegSizes {
			pieces := cfg.pieces(ScatteredSegments(dir, uint64(host), uint64(dev), size, int(cfg.TotalBytes/size), rng), size)
			for _, m := range methods {
				gbps, err := c.timePoint(s, ev, dir, pieces, m, cfg)
				if err != nil {
					return nil, fmt.Errorf("cudacopy: calibrating %s %s at %s: %w", m, dir, FormatBytes(size), err)
				}
				out.Entries = append(out.Entries, Measurement{Dir: dir, Method: m, SegBytes: size, GBps: gbps})
			}
		}
	}
	if err := c.SetCalibration(out); err != nil {
		return nil, err
	}
	return out, nil
}

// timePoint runs up to cfg.Reps pipelines of m within cfg.PointBudget and
// returns the best rate in GB/s.
func (c *Copier) timePoint(s cuda.Stream, ev [2]cuda.Event, dir Path, pieces [][]Segment, m Method, cfg CalibrationConfig) (float64, error) {
	start := time.Now()
	best := 0.0
	for r := range cfg.Reps {
		if r > 0 && time.Since(start) >= cfg.PointBudget {
			break
		}
		gbps, err := c.timePipeline(s, ev, dir, pieces, m, cfg.Pieces, cfg.PointBudget)
		if err != nil {
			return 0, err
		}
		best = max(best, gbps)
	}
	return best, nil
}

// timePipeline submits pieces[0] as the untimed lead, records ev[0], then
// submits up to n more pieces (cycling through pieces[1:], or pieces[0]
// alone) back to back, stopping early once budget has passed since the lead
// (budget 0: never), records ev[1] and returns the timed pieces' bytes over
// the events' elapsed time, in GB/s. Every ticket is retired before it
// returns, after the stream has drained on failure.
func (c *Copier) timePipeline(s cuda.Stream, ev [2]cuda.Event, dir Path, pieces [][]Segment, m Method, n int, budget time.Duration) (gbps float64, err error) {
	if len(pieces) == 0 {
		return 0, fmt.Errorf("%w: calibration pipeline without segments", ErrInvalidOption)
	}
	tickets := make([]Ticket, 0, n+1)
	synced := false
	defer func() {
		if err != nil && !synced {
			err = errors.Join(err, c.drv.StreamSynchronize(s))
		}
		for _, t := range tickets {
			err = errors.Join(err, c.Retire(t))
		}
	}()
	submit := func(p []Segment) error {
		t, err := c.submitWith(s, dir, p, m)
		if err != nil {
			return err
		}
		tickets = append(tickets, t)
		return nil
	}
	if err := submit(pieces[0]); err != nil {
		return 0, err
	}
	if err := c.drv.EventRecord(ev[0], s); err != nil {
		return 0, err
	}
	lead := time.Now()
	var bytes uint64
	for k := range n {
		if k > 0 && budget > 0 && time.Since(lead) >= budget {
			break
		}
		p := pieces[0]
		if len(pieces) > 1 {
			p = pieces[1+k%(len(pieces)-1)]
		}
		if err := submit(p); err != nil {
			return 0, err
		}
		for _, sg := range p {
			bytes += sg.Len
		}
	}
	if err := c.drv.EventRecord(ev[1], s); err != nil {
		return 0, err
	}
	if err := c.drv.EventSynchronize(ev[1]); err != nil {
		return 0, err
	}
	synced = true
	ms, err := c.drv.EventElapsedTime(ev[0], ev[1])
	if err != nil {
		return 0, err
	}
	if ms <= 0 {
		return 0, fmt.Errorf("cudacopy: timing: non-positive elapsed time %v ms for %d bytes", ms, bytes)
	}
	return float64(bytes) / (float64(ms) * 1e6), nil
}
