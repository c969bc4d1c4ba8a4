package bench

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/mmapmem"
	"github.com/kvoffload/kvoffload/register"
)

// Pinning targets at 48 GiB (issue 2).
const (
	PinningTargetSize    int64   = 48 << 30
	PinningTargetGiBps   float64 = 18
	PinningTargetSpeedup float64 = 7
)

// PinningOptions configure MeasurePinning.
type PinningOptions struct {
	// Region are the options of the regions measured (the zero value:
	// transparent huge pages, prefault on DefaultPrefaultThreads threads).
	Region mmapmem.Options
	// RangeLimit is the CUDA registration range limit (0: 64 GiB).
	RangeLimit int64
	// SkipHostAlloc leaves out the cuMemHostAlloc reference.
	SkipHostAlloc bool
}

// PinningResult is the time to get Size bytes of pinned memory two ways.
type PinningResult struct {
	Size int64
	// Ours: mmapmem.New (mmap, advice, parallel prefault) then a CUDA
	// registration.
	Map      time.Duration
	Register time.Duration
	Total    time.Duration
	GiBps    float64 // Size / Total
	Mapped   int64   // bytes owned: the region's mapped size
	PageSize int64   // the region's page size (rounding unit)
	Ranges   int     // registration ranges
	Threads  int     // prefault threads
	Fallback string  // what the region could not honour, if anything
	// The reference: one cuMemHostAlloc of Size bytes (which backs and pins
	// every page before it returns), and its cuMemFreeHost. Zero when
	// skipped.
	HostAlloc     time.Duration
	HostAllocFree time.Duration
	HostAllocGiBs float64
	// Speedup is HostAlloc / Total (0 when the reference was skipped).
	Speedup float64
}

// Extra is the number of bytes owned beyond the size asked for.
func (r PinningResult) Extra() int64 { return r.Mapped - r.Size }

// MeasurePinning measures, for each size, the end-to-end time to pinned
// memory through mmapmem and register, then the same size through
// cuMemHostAlloc, one after the other so that both never hold memory at
// once. It retains dev's primary context for the duration.
func MeasurePinning(drv cuda.Driver, dev cuda.Device, sizes []int64, opts PinningOptions) (results []PinningResult, err error) {
	for _, s := range sizes {
		if s <= 0 || s > mmapmem.MaxSize {
			return nil, fmt.Errorf("bench: pinning size %d: must be in [1, %d]", s, mmapmem.MaxSize)
		}
	}
	ctx, err := drv.PrimaryCtxRetain(dev)
	if err != nil {
		return nil, fmt.Errorf("bench: retain primary context of device %d: %w", dev, err)
	}
	defer func() {
		if rerr := drv.PrimaryCtxRelease(dev); rerr != nil {
			err = errors.Join(err, fmt.Errorf("bench: release primary context: %w", rerr))
		}
	}()
	p, err := register.NewCUDA(drv, ctx, register.CUDAOptions{RangeLimit: opts.RangeLimit})
	if err != nil {
		return nil, err
	}
	threads := opts.Region.PrefaultThreads
	if threads == 0 {
		threads = mmapmem.DefaultPrefaultThreads()
	}
	for _, size := range sizes {
		res := PinningResult{Size: size, Threads: threads}
		if err := measureOurs(p, size, opts.Region, &res); err != nil {
			return results, err
		}
		if !opts.SkipHostAlloc {
			if err := measureHostAlloc(drv, ctx, size, &res); err != nil {
				return results, err
			}
		}
		results = append(results, res)
	}
	return results, nil
}

func measureOurs(p *register.CUDA, size int64, opts mmapmem.Options, res *PinningResult) error {
	start := time.Now()
	r, err := mmapmem.New(size, opts)
	if err != nil {
		return fmt.Errorf("bench: map %d bytes: %w", size, err)
	}
	res.Map = time.Since(start)
	start = time.Now()
	err = p.Register(r)
	res.Register = time.Since(start)
	if err != nil {
		return errors.Join(fmt.Errorf("bench: register %d bytes: %w", size, err), r.Close())
	}
	res.Total = res.Map + res.Register
	res.GiBps = gibps(size, res.Total)
	res.Mapped = r.Mapped()
	res.PageSize = r.PageSize()
	res.Ranges = len(p.Ranges(r))
	res.Fallback = r.Fallback()
	return register.Release(p, r)
}

func measureHostAlloc(drv cuda.Driver, ctx cuda.Context, size int64, res *PinningResult) error {
	return cuda.OnThread(drv, ctx, func() error {
		start := time.Now()
		ptr, err := drv.MemHostAlloc(uint64(size), cuda.HostAllocPortable|cuda.HostAllocDeviceMap)
		res.HostAlloc = time.Since(start)
		if err != nil {
			return fmt.Errorf("bench: cuMemHostAlloc %d bytes: %w", size, err)
		}
		start = time.Now()
		err = drv.MemFreeHost(ptr)
		res.HostAllocFree = time.Since(start)
		if err != nil {
			return fmt.Errorf("bench: cuMemFreeHost %d bytes: %w", size, err)
		}
		res.HostAllocGiBs = gibps(size, res.HostAlloc)
		if res.Total > 0 {
			res.Speedup = res.HostAlloc.Seconds() / res.Total.Seconds()
		}
		return nil
	})
}

func gibps(size int64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(size) / (1 << 30) / d.Seconds()
}

// FormatPinning renders results as a markdown table with the targets and,
// when a 48 GiB row is present, whether it meets them.
func FormatPinning(results []PinningResult) string {
	var b strings.Builder
	b.WriteString("| size | mmap + prefault | register | total | GiB/s | ranges | bytes beyond asked | cuMemHostAlloc | its GiB/s | speed-up |\n")
	b.WriteString("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	var threads int
	var fallbacks []string
	for _, r := range results {
		threads = r.Threads
		ref, refRate, speed := "–", "–", "–"
		if r.HostAlloc > 0 {
			ref, refRate, speed = ms(r.HostAlloc), fmt.Sprintf("%.1f", r.HostAllocGiBs), fmt.Sprintf("%.1f×", r.Speedup)
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %.1f | %d | %d | %s | %s | %s |\n",
			sizeString(r.Size), ms(r.Map), ms(r.Register), ms(r.Total), r.GiBps, r.Ranges, r.Extra(), ref, refRate, speed)
		if r.Fallback != "" {
			fallbacks = append(fallbacks, fmt.Sprintf("%s: %s", sizeString(r.Size), r.Fallback))
		}
	}
	fmt.Fprintf(&b, "\nOurs: mmapmem.New (THP unless disabled, prefault on %d threads) + cuMemHostRegister_v2 (PORTABLE|DEVICEMAP) in registration ranges. "+
		"cuMemHostAlloc: one call of the same size (pages backed and pinned on return), owned bytes taken as asked: the driver does not report its rounding.\n", threads)
	for _, f := range fallbacks {
		fmt.Fprintf(&b, "Fallback at %s\n", f)
	}
	fmt.Fprintf(&b, "Target at %s: ≥ %.0f GiB/s end to end, ≥ %.0f× faster than cuMemHostAlloc, no bytes beyond page rounding.\n",
		sizeString(PinningTargetSize), PinningTargetGiBps, PinningTargetSpeedup)
	for _, r := range results {
		if r.Size != PinningTargetSize {
			continue
		}
		verdict := "met"
		if r.GiBps < PinningTargetGiBps || (r.HostAlloc > 0 && r.Speedup < PinningTargetSpeedup) || r.Extra() >= r.PageSize {
			verdict = "MISSED"
		}
		speed := "not measured"
		if r.HostAlloc > 0 {
			speed = fmt.Sprintf("%.1f×", r.Speedup)
		}
		fmt.Fprintf(&b, "At %s: %.1f GiB/s, %s, %d bytes beyond asked: target %s.\n", sizeString(r.Size), r.GiBps, speed, r.Extra(), verdict)
	}
	return b.String()
}

func ms(d time.Duration) string {
	v := float64(d) / float64(time.Millisecond)
	if v < 10 {
		return fmt.Sprintf("%.2f ms", v)
	}
	return fmt.Sprintf("%.0f ms", v)
}

func sizeString(n int64) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return fmt.Sprintf("%d GiB", n>>30)
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	default:
		return fmt.Sprintf("%d B", n)
	}
}
