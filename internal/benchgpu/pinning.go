package benchgpu

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"time"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cudadev"
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
	// PipelineChunk is the pinner's pipeline chunk (0:
	// register.DefaultPipelineChunk): ours maps the region with
	// mmapmem.Options.DeferPrefault and the CUDA pinner's Register
	// (register.NewCUDA) prefaults range k+1 while it registers range k.
	PipelineChunk int64
	// Sequential measures ours the old way instead: mmapmem.New prefaults
	// the whole region, then Register registers it in RangeLimit ranges.
	Sequential bool
	// SkipHostAlloc leaves out the cuMemHostAlloc reference.
	SkipHostAlloc bool
}

// PinningResult is the time to get Size bytes of pinned memory two ways,
// measured in the order ours (cold), cuMemHostAlloc, ours (warm).
type PinningResult struct {
	Size int64
	// Cold is our first run at this size, before cuMemHostAlloc. On a
	// virtual machine its first touch of guest memory the process never
	// used pays the hypervisor's faults (EPT/NPT backing), which every
	// later allocation of the same memory, ours or the driver's, is spared.
	Cold PinningRun
	// Ours (the fields below, through Fallback): the warm run, after
	// cuMemHostAlloc, on memory the guest has backed once: what an engine
	// starting on a warmed machine sees, and what cuMemHostAlloc is
	// compared with. Map is mmapmem.New, Register is the CUDA pinner's Register (register.NewCUDA).
	// Pipelined (Chunk > 0): New maps and advises without touching, and
	// Register prefaults range k+1 while it registers range k. Sequential
	// (Chunk = 0): New prefaults everything, then Register registers.
	Map      time.Duration
	Register time.Duration
	Chunk    int64 // the pipeline chunk; 0 when measured sequentially
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
	// Speedup is HostAlloc / Total (0 when the reference was skipped);
	// ColdSpeedup is HostAlloc / Cold.Total.
	Speedup     float64
	ColdSpeedup float64
}

// PinningRun is one end-to-end run of ours.
type PinningRun struct {
	Map, Register, Total time.Duration
	GiBps                float64
}

// Extra is the number of bytes owned beyond the size asked for.
func (r PinningResult) Extra() int64 { return r.Mapped - r.Size }

// MeasurePinning measures, for each size, the end-to-end time to pinned
// memory through mmapmem and register (cold; pipelined unless
// opts.Sequential, see PinningOptions), then the same size through
// cuMemHostAlloc, then ours again (warm), one after the other so that no
// two hold memory at once. It retains dev's primary context for the
// duration.
func MeasurePinning(drv cuda.Driver, dev cuda.Device, sizes []int64, opts PinningOptions) (results []PinningResult, err error) {
	for _, s := range sizes {
		if err := checkPinningSize(s); err != nil {
			return nil, err
		}
	}
	ctx, release, err := retainPrimary(drv, dev)
	if err != nil {
		return nil, err
	}
	defer release(&err)
	p, err := register.NewCUDA(cudadev.Bind(drv, ctx), register.CUDAOptions{RangeLimit: opts.RangeLimit, PipelineChunk: opts.PipelineChunk})
	if err != nil {
		return nil, err
	}
	threads := opts.Region.PrefaultThreads
	if threads == 0 {
		threads = mmapmem.DefaultPrefaultThreads()
	}
	region := opts.Region
	var chunk int64
	if !opts.Sequential {
		region.NoPrefault, region.DeferPrefault = false, true
		chunk = cmp.Or(opts.PipelineChunk, register.DefaultPipelineChunk)
		if opts.RangeLimit > 0 {
			chunk = min(chunk, opts.RangeLimit)
		}
	}
	for _, size := range sizes {
		res := PinningResult{Size: size, Threads: threads, Chunk: chunk}
		if err := measureOurs(p, size, region, &res); err != nil {
			return results, err
		}
		res.Cold = PinningRun{Map: res.Map, Register: res.Register, Total: res.Total, GiBps: res.GiBps}
		if !opts.SkipHostAlloc {
			if err := measureHostAlloc(drv, ctx, size, &res); err != nil {
				return results, err
			}
		}
		if err := measureOurs(p, size, region, &res); err != nil {
			return results, err
		}
		if res.HostAlloc > 0 {
			res.Speedup = res.HostAlloc.Seconds() / res.Total.Seconds()
			res.ColdSpeedup = res.HostAlloc.Seconds() / res.Cold.Total.Seconds()
		}
		results = append(results, res)
	}
	return results, nil
}

func measureOurs(p register.Pinner, size int64, opts mmapmem.Options, res *PinningResult) error {
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
	b.WriteString("| size | cold: New | Register | total | GiB/s | warm: New | Register | total | GiB/s | ranges | bytes beyond asked | cuMemHostAlloc | its GiB/s | speed-up warm (cold) |\n")
	b.WriteString("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	var threads int
	var chunk int64
	var fallbacks []string
	for _, r := range results {
		threads, chunk = r.Threads, r.Chunk
		ref, refRate, speed := "–", "–", "–"
		if r.HostAlloc > 0 {
			ref, refRate, speed = ms(r.HostAlloc), fmt.Sprintf("%.1f", r.HostAllocGiBs), fmt.Sprintf("%.1f× (%.1f×)", r.Speedup, r.ColdSpeedup)
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %.1f | %s | %s | %s | %.1f | %d | %d | %s | %s | %s |\n",
			sizeString(r.Size), ms(r.Cold.Map), ms(r.Cold.Register), ms(r.Cold.Total), r.Cold.GiBps,
			ms(r.Map), ms(r.Register), ms(r.Total), r.GiBps, r.Ranges, r.Extra(), ref, refRate, speed)
		if r.Fallback != "" {
			fallbacks = append(fallbacks, fmt.Sprintf("%s: %s", sizeString(r.Size), r.Fallback))
		}
	}
	if chunk > 0 {
		fmt.Fprintf(&b, "\nOurs, pipelined: New = mmapmem.New with DeferPrefault (mmap and advice, THP unless disabled, nothing touched); "+
			"Register = register.NewCUDA's Pinner.Register in %s ranges, prefaulting range k+1 on %d threads while cuMemHostRegister_v2 (PORTABLE|DEVICEMAP) registers range k.\n", sizeString(chunk), threads)
	} else {
		fmt.Fprintf(&b, "\nOurs, sequential: New = mmapmem.New (mmap, advice, THP unless disabled, prefault on %d threads); "+
			"Register = cuMemHostRegister_v2 (PORTABLE|DEVICEMAP) in registration ranges.\n", threads)
	}
	fmt.Fprintf(&b, "cuMemHostAlloc: one call of the same size (pages backed and pinned on return), owned bytes taken as asked: the driver does not report its rounding.\n"+
		"Order per size: ours (cold), cuMemHostAlloc, ours (warm), each freed before the next. On a virtual machine the first touch of guest memory the process never used pays the hypervisor's faults (EPT backing): the cold run pays them, cuMemHostAlloc and the warm run reuse that backed memory. Warm is the like-for-like comparison with cuMemHostAlloc; cold is what a freshly booted VM pays once.\n")
	for _, f := range fallbacks {
		fmt.Fprintf(&b, "Fallback at %s\n", f)
	}
	fmt.Fprintf(&b, "Target at %s: ≥ %.0f GiB/s end to end, ≥ %.0f× faster than cuMemHostAlloc, no bytes beyond page rounding.\n",
		sizeString(PinningTargetSize), PinningTargetGiBps, PinningTargetSpeedup)
	for _, r := range results {
		if r.Size != PinningTargetSize {
			continue
		}
		for _, run := range []struct {
			name  string
			gibps float64
			speed float64
		}{{"warm", r.GiBps, r.Speedup}, {"cold", r.Cold.GiBps, r.ColdSpeedup}} {
			verdict := "met"
			if run.gibps < PinningTargetGiBps || (r.HostAlloc > 0 && run.speed < PinningTargetSpeedup) || r.Extra() >= r.PageSize {
				verdict = "MISSED"
			}
			speed := "not measured"
			if r.HostAlloc > 0 {
				speed = fmt.Sprintf("%.1f×", run.speed)
			}
			fmt.Fprintf(&b, "At %s, %s: %.1f GiB/s, %s, %d bytes beyond asked: target %s.\n", sizeString(r.Size), run.name, run.gibps, speed, r.Extra(), verdict)
		}
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

// PinningVariant is one way of getting a region ready, measured by
// MeasurePinningVariants.
type PinningVariant struct {
	Name   string
	Region mmapmem.Options
	// Register also times the CUDA registration of the prefaulted region.
	Register bool
}

// PinningVariantResult is one variant's measurement.
type PinningVariantResult struct {
	Variant PinningVariant
	// Prefault is mmapmem.New: mmap, advice and prefault.
	Prefault time.Duration
	// Register is zero unless Variant.Register.
	Register time.Duration
	// PrefaultGiBps is Size / Prefault.
	PrefaultGiBps float64
	// HugeBytes are the bytes backed by huge pages right after New.
	HugeBytes int64
	Size      int64
}

// PinningEnv is what bounds prefault speed on the machine.
type PinningEnv struct {
	GOMAXPROCS, NumCPU int
	// CPUMax is /sys/fs/cgroup/cpu.max ("max 100000" when not limited).
	CPUMax string
	// THPEnabled and THPDefrag are /sys/kernel/mm/transparent_hugepage/
	// enabled and defrag.
	THPEnabled, THPDefrag string
	Kernel                string
}

// ReadPinningEnv reads the environment facts FormatPinningVariants prints;
// a file that cannot be read reads as "?".
func ReadPinningEnv() PinningEnv {
	read := func(p string) string {
		b, err := os.ReadFile(p)
		if err != nil {
			return "?"
		}
		return strings.TrimSpace(string(b))
	}
	return PinningEnv{
		GOMAXPROCS: runtime.GOMAXPROCS(0),
		NumCPU:     runtime.NumCPU(),
		CPUMax:     read("/sys/fs/cgroup/cpu.max"),
		THPEnabled: read("/sys/kernel/mm/transparent_hugepage/enabled"),
		THPDefrag:  read("/sys/kernel/mm/transparent_hugepage/defrag"),
		Kernel:     read("/proc/sys/kernel/osrelease"),
	}
}

// DefaultPinningVariants are the prefault method × threads × work split
// sweep, plus registration with and without transparent huge pages.
func DefaultPinningVariants() []PinningVariant {
	var vs []PinningVariant
	methods := []mmapmem.PrefaultMethod{mmapmem.PrefaultTouch, mmapmem.PrefaultPopulate}
	for _, m := range methods {
		for _, th := range []int{1, 4, 16} {
			vs = append(vs, PinningVariant{Name: fmt.Sprintf("%s ×%d", m, th), Region: mmapmem.Options{Prefault: m, PrefaultThreads: th}})
		}
	}
	for _, m := range methods {
		for _, stripe := range []int64{2 << 20, 64 << 20} {
			vs = append(vs, PinningVariant{Name: fmt.Sprintf("%s ×16 stripes %s", m, sizeString(stripe)), Region: mmapmem.Options{Prefault: m, PrefaultThreads: 16, PrefaultStripe: stripe}})
		}
	}
	for _, m := range methods {
		vs = append(vs, PinningVariant{Name: fmt.Sprintf("%s ×16 THP + register", m), Region: mmapmem.Options{Prefault: m, PrefaultThreads: 16}, Register: true})
		vs = append(vs, PinningVariant{Name: fmt.Sprintf("%s ×16 no THP + register", m), Region: mmapmem.Options{Prefault: m, PrefaultThreads: 16, NoTHP: true}, Register: true})
	}
	return vs
}

// checkPinningSize refuses a size no region can have.
func checkPinningSize(size int64) error {
	if size <= 0 || size > mmapmem.MaxSize {
		return fmt.Errorf("bench: pinning size %d: must be in [1, %d]", size, mmapmem.MaxSize)
	}
	return nil
}

// retainPrimary retains dev's primary context; release gives it back,
// joining a failure into *err.
func retainPrimary(drv cuda.Driver, dev cuda.Device) (ctx cuda.Context, release func(err *error), err error) {
	ctx, err = drv.PrimaryCtxRetain(dev)
	if err != nil {
		return 0, nil, fmt.Errorf("bench: retain primary context of device %d: %w", dev, err)
	}
	return ctx, func(err *error) {
		if rerr := drv.PrimaryCtxRelease(dev); rerr != nil {
			*err = errors.Join(*err, fmt.Errorf("bench: release primary context: %w", rerr))
		}
	}, nil
}

// MeasurePinningVariants maps, prefaults (and where asked registers) size
// bytes once per variant, after one unreported warm-up with the default
// options, releasing each region before the next. It retains dev's primary
// context for the duration.
func MeasurePinningVariants(drv cuda.Driver, dev cuda.Device, size int64, variants []PinningVariant) (results []PinningVariantResult, err error) {
	if err := checkPinningSize(size); err != nil {
		return nil, err
	}
	ctx, release, err := retainPrimary(drv, dev)
	if err != nil {
		return nil, err
	}
	defer release(&err)
	p, err := register.NewCUDA(cudadev.Bind(drv, ctx), register.CUDAOptions{})
	if err != nil {
		return nil, err
	}
	warm, err := mmapmem.New(size, mmapmem.Options{})
	if err != nil {
		return nil, fmt.Errorf("bench: warm-up map of %d bytes: %w", size, err)
	}
	if err := warm.Close(); err != nil {
		return nil, err
	}
	for _, v := range variants {
		res := PinningVariantResult{Variant: v, Size: size}
		start := time.Now()
		r, err := mmapmem.New(size, v.Region)
		res.Prefault = time.Since(start)
		if err != nil {
			return results, fmt.Errorf("bench: variant %q: map %d bytes: %w", v.Name, size, err)
		}
		res.PrefaultGiBps = gibps(size, res.Prefault)
		if res.HugeBytes, err = mmapmem.HugeBytes(r); err != nil {
			return results, errors.Join(err, r.Close())
		}
		if v.Register {
			start = time.Now()
			err = p.Register(r)
			res.Register = time.Since(start)
			if err != nil {
				return results, errors.Join(fmt.Errorf("bench: variant %q: register %d bytes: %w", v.Name, size, err), r.Close())
			}
			if err := register.Release(p, r); err != nil {
				return results, err
			}
		} else if err := r.Close(); err != nil {
			return results, err
		}
		results = append(results, res)
	}
	return results, nil
}

// FormatPinningVariants renders the sweep as a markdown table, the
// environment that bounds it, and the fastest prefault variant.
func FormatPinningVariants(env PinningEnv, results []PinningVariantResult) string {
	var b strings.Builder
	fmt.Fprintf(&b, "GOMAXPROCS %d, NumCPU %d, cgroup cpu.max %q, THP enabled %q, defrag %q, kernel %s.\n\n",
		env.GOMAXPROCS, env.NumCPU, env.CPUMax, env.THPEnabled, env.THPDefrag, env.Kernel)
	b.WriteString("| variant | size | prefault | prefault GiB/s | huge pages | register | prefault + register GiB/s |\n|---|---:|---:|---:|---:|---:|---:|\n")
	var best *PinningVariantResult
	for i, r := range results {
		reg, total := "–", "–"
		if r.Variant.Register {
			reg = ms(r.Register)
			total = fmt.Sprintf("%.1f", gibps(r.Size, r.Prefault+r.Register))
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %.1f | %.0f%% | %s | %s |\n", r.Variant.Name, sizeString(r.Size), ms(r.Prefault), r.PrefaultGiBps,
			100*float64(r.HugeBytes)/float64(max(r.Size, 1)), reg, total)
		if best == nil || r.Prefault < best.Prefault {
			best = &results[i]
		}
	}
	if best != nil {
		fmt.Fprintf(&b, "\nFastest prefault: %s (%.1f GiB/s, method %s; mmapmem.DefaultPrefaultMethod is %s).\n",
			best.Variant.Name, best.PrefaultGiBps, best.Variant.Region.Prefault, mmapmem.DefaultPrefaultMethod)
	}
	return b.String()
}
