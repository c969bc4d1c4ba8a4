package cudacopy

import (
	"errors"
	"fmt"
	"math/rand/v2"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

// CalibrationConfig says what Calibrate measures. Zero fields take defaults.
type CalibrationConfig struct {
	// TotalBytes copied per measurement (default 32 MiB).
	TotalBytes uint64 `json:"total_bytes"`
	// SegSizes are the segment sizes measured (default 4, 16, 64, 256 KiB
	// and 2 MiB); each a multiple of 16 no larger than TotalBytes.
	SegSizes []uint64 `json:"seg_sizes"`
	// Reps timed per point after one warm-up; the best counts (default 3).
	Reps int `json:"reps"`
	// Seed of the random slot permutations.
	Seed uint64 `json:"seed"`
}

// DefaultSegSizes are the KV segment sizes the engine is tuned for.
var DefaultSegSizes = []uint64{4 << 10, 16 << 10, 64 << 10, 256 << 10, 2 << 20}

func (c CalibrationConfig) withDefaults() CalibrationConfig {
	if c.TotalBytes == 0 {
		c.TotalBytes = 32 << 20
	}
	if len(c.SegSizes) == 0 {
		c.SegSizes = DefaultSegSizes
	}
	if c.Reps == 0 {
		c.Reps = 3
	}
	return c
}

func (c CalibrationConfig) validate() error {
	if c.Reps < 1 {
		return fmt.Errorf("%w: calibration Reps %d is not positive", ErrInvalidOption, c.Reps)
	}
	for _, s := range c.SegSizes {
		if s == 0 || s%kernelAlign != 0 || s > c.TotalBytes {
			return fmt.Errorf("%w: calibration segment size %d is not a multiple of %d in (0, TotalBytes %d]", ErrInvalidOption, s, kernelAlign, c.TotalBytes)
		}
	}
	return nil
}

// ScatteredSegments returns n segments of size bytes moving between slot
// ph[i] of the host side and slot pd[i] of the device side, where ph and pd
// are independent random permutations of [0, n): the "random slots on both
// sides" pattern of the benchmarks. dir says which side is the source.
func ScatteredSegments(dir Direction, host, dev, size uint64, n int, rng *rand.Rand) []Segment {
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

// Calibrate times every available method (memcpy, batch, the kernel at the
// configured CTAs) for each direction and segment size of
// Options.Calibrate on stream s, with segments at random slots of a pinned
// buffer and a device buffer it allocates and frees, installs the result as
// the table Choose uses, and returns it. s must be otherwise idle; the call
// blocks until the measurements are done.
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
	dev, err := c.drv.MemAlloc(cfg.TotalBytes)
	if err != nil {
		return nil, fmt.Errorf("cudacopy: calibration device buffer of %d bytes: %w", cfg.TotalBytes, err)
	}
	defer func() { err = errors.Join(err, c.drv.MemFree(dev)) }()
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
	out := &Calibration{CTAs: c.opts.CTAs, TotalBytes: cfg.TotalBytes}
	for _, dir := range [...]Direction{D2H, H2D} {
		for _, size := range cfg.SegSizes {
			segs := ScatteredSegments(dir, uint64(host), uint64(dev), size, int(cfg.TotalBytes/size), rng)
			bytes := size * uint64(len(segs))
			for _, m := range methods {
				ms, err := c.timeBest(s, ev, dir, segs, m, cfg.Reps)
				if err != nil {
					return nil, fmt.Errorf("cudacopy: calibrating %s %s at %s: %w", m, dir, FormatBytes(size), err)
				}
				out.Entries = append(out.Entries, Measurement{Dir: dir, Method: m, SegBytes: size, GBps: float64(bytes) / (ms * 1e6)})
			}
		}
	}
	if err := c.SetCalibration(out); err != nil {
		return nil, err
	}
	return out, nil
}

// timeBest runs one warm-up and reps timed submissions, returning the best
// time in milliseconds.
func (c *Copier) timeBest(s cuda.Stream, ev [2]cuda.Event, dir Direction, segs []Segment, m Method, reps int) (float64, error) {
	best := -1.0
	for r := range reps + 1 {
		if err := c.drv.EventRecord(ev[0], s); err != nil {
			return 0, err
		}
		t, err := c.submitWith(s, dir, segs, m)
		if err != nil {
			return 0, err
		}
		if err := c.drv.EventRecord(ev[1], s); err != nil {
			return 0, errors.Join(err, c.drv.StreamSynchronize(s), c.Retire(t))
		}
		if err := c.drv.EventSynchronize(ev[1]); err != nil {
			return 0, errors.Join(err, c.Retire(t))
		}
		if err := c.Retire(t); err != nil {
			return 0, err
		}
		ms, err := c.drv.EventElapsedTime(ev[0], ev[1])
		if err != nil {
			return 0, err
		}
		if r > 0 && (best < 0 || float64(ms) < best) {
			best = float64(ms)
		}
	}
	if best <= 0 {
		return 0, fmt.Errorf("cudacopy: timing: non-positive elapsed time %v ms", best)
	}
	return best, nil
}
