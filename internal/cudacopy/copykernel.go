package cudacopy

// The copy kernel's launch per direction: Launch, the default launches,
// how Options resolve and validate them, the copy kernels of kernels.cu,
// and the throttled kernels' fence (or read-back) interval and pace. No
// locks: launches are plain values, and fenceBytes reads only the
// Copier's options.

import (
	"fmt"
	"math"
	"strings"
)

// Launch is one direction's copy-kernel launch: grid, kernel and, for a
// throttled kernel on D2H, its throttles (Options.FenceBytes and
// PaceGBps).
type Launch struct {
	CTAs       int     `json:"ctas"`
	Threads    int     `json:"threads"`
	Kernel     string  `json:"kernel"`
	FenceBytes int     `json:"fence_bytes,omitempty"`
	PaceGBps   float64 `json:"pace_gbps,omitempty"`
}

func (l Launch) String() string {
	s := fmt.Sprintf("%s %d×%d", l.Kernel, l.CTAs, l.Threads)
	if l.FenceBytes > 0 {
		what := "fence"
		if _, throttle := copyKernel(l.Kernel); throttle != "" {
			what = throttle
		}
		s += " " + what + " " + FormatBytes(uint64(l.FenceBytes))
	}
	if l.PaceGBps > 0 {
		s += fmt.Sprintf(" pace %g GB/s", l.PaceGBps)
	}
	return s
}

// The default launches are the fewest warps that still move small
// segments near link speed while leaving the model's kernels on the other
// SMs nearly untouched (the sweeps of internal/benchgpu chose them):
//   - H2D: kvo_copy on 4 CTAs × 512 threads. More warps add no rate and
//     slow the model's kernels; fewer lose rate on 4 KiB segments.
//   - D2H: stores to host memory are posted, and an unthrottled kernel's
//     backlog of them holds up the other SMs' memory traffic. So the
//     default is kvo_copy_probe on 8 × 192: each warp reads back a word it
//     stored after every 4 KiB and waits for it, which bounds its stores
//     in flight at a small cost in rate. (kvo_copy_sys's system fence
//     bounds them too, but waits for every earlier store of the warp, and
//     costs more rate.) Only whole 4 KiB iterations of a warp are
//     throttled: a segment or chunk (Options.ChunkBytes) under 4 KiB, a
//     misaligned segment and a segment's tail are stored without a
//     read-back.
var (
	defaultH2D = Launch{CTAs: 4, Threads: 512, Kernel: DefaultCopyKernel}
	defaultD2H = Launch{CTAs: 8, Threads: 192, Kernel: ProbeCopyKernel, FenceBytes: DefaultFenceBytes}
	greedyD2H  = Launch{CTAs: 8, Threads: 1024, Kernel: DefaultCopyKernel}
)

// DefaultLaunch is the launch used for dir where Options leaves CTAs,
// Threads and CopyKernel zero: kvo_copy on 4 × 512 for H2D and D2D; for D2H,
// kvo_copy_probe on 8 × 192 reading back after every 4 KiB per warp (8 KiB
// for a batch of segments under 8 KiB, see SmallSegmentFenceBytes), or
// with greedy (Options.GreedyD2H) GreedyD2HLaunch.
func DefaultLaunch(dir Path, greedy bool) Launch {
	switch {
	case dir != D2H:
		return defaultH2D
	case greedy:
		return greedyD2H
	}
	return defaultD2H
}

// DefaultStagedCTAs is the default grid of the staged copies' device-side
// kernel (Options.StagedCTAs).
const DefaultStagedCTAs = 4

// stagedLaunch is the launch of the staged copies' device-side kernel: the
// H2D launch's kernel and threads (an unthrottled kernel: device memory
// on both sides) on StagedCTAs CTAs, at most the device's sms.
func (o *Options) stagedLaunch(sms int) Launch {
	l := o.launch(H2D)
	l.CTAs = min(DefaultStagedCTAs, max(sms, 1))
	if o.StagedCTAs != 0 {
		l.CTAs = o.StagedCTAs
	}
	return l
}

// GreedyD2HLaunch is kvo_copy unthrottled on 8 CTAs × 1024 threads: a
// little faster than the default D2H launch, at the price of slowing the
// model's kernels beside it several times over (see DefaultLaunch).
func GreedyD2HLaunch() Launch { return greedyD2H }

// launch resolves dir's launch: the direction's default, each field
// Options sets overriding it. Only D2H launches keep a fence or a pace.
func (o *Options) launch(dir Path) Launch {
	l := DefaultLaunch(dir, o.GreedyD2H)
	if o.CopyKernel != "" && o.CopyKernel != l.Kernel {
		l.Kernel, l.FenceBytes, l.PaceGBps = o.CopyKernel, 0, 0
		if l.Throttled() {
			l.FenceBytes = DefaultFenceBytes
		}
	}
	if o.CTAs != 0 {
		l.CTAs = o.CTAs
	}
	if o.Threads != 0 {
		l.Threads = o.Threads
	}
	if o.FenceBytes != 0 {
		l.FenceBytes = o.FenceBytes
	}
	if o.PaceGBps != 0 {
		l.PaceGBps = o.PaceGBps
	}
	if dir != D2H {
		l.FenceBytes, l.PaceGBps = 0, 0
	}
	return l
}

func (l Launch) validate(dir Path, sms int) error {
	known, throttle := copyKernel(l.Kernel)
	throttled := throttle != ""
	switch {
	case l.CTAs < 1 || l.CTAs > sms:
		return fmt.Errorf("%w: CTAs %d not in [1, %d] (the device's SM count)", ErrInvalidOption, l.CTAs, sms)
	case l.Threads < 32 || l.Threads > maxThreads || l.Threads%32 != 0:
		return fmt.Errorf("%w: Threads %d is not a multiple of 32 in [32, %d]", ErrInvalidOption, l.Threads, maxThreads)
	case !known:
		return fmt.Errorf("%w: CopyKernel %q is not one of %s", ErrInvalidOption, l.Kernel, copyKernelNames())
	case !throttled && l.FenceBytes != 0:
		return fmt.Errorf("%w: FenceBytes %d is only for a throttled CopyKernel such as %q, not the %v kernel %q", ErrInvalidOption, l.FenceBytes, SysFenceCopyKernel, dir, l.Kernel)
	case !throttled && l.PaceGBps != 0:
		return fmt.Errorf("%w: PaceGBps %v is only for a throttled CopyKernel such as %q, not the %v kernel %q", ErrInvalidOption, l.PaceGBps, SysFenceCopyKernel, dir, l.Kernel)
	case l.FenceBytes < 0 || l.FenceBytes%FenceUnit != 0 || l.FenceBytes > 1<<30:
		return fmt.Errorf("%w: FenceBytes %d is not a multiple of %d in [0, %d]", ErrInvalidOption, l.FenceBytes, FenceUnit, 1<<30)
	case !(l.PaceGBps >= 0 && l.PaceGBps <= maxPaceGBps):
		return fmt.Errorf("%w: PaceGBps %v not in [0, %d]", ErrInvalidOption, l.PaceGBps, maxPaceGBps)
	}
	return nil
}

// Copy kernels of kernels.cu.
const (
	DefaultCopyKernel   = "kvo_copy"
	StreamingCopyKernel = "kvo_copy_cs"
	SysFenceCopyKernel  = "kvo_copy_sys"
	// ProbeCopyKernel is kvo_copy_sys throttled by reading back a word it
	// stored instead of a fence: the default D2H kernel.
	ProbeCopyKernel = "kvo_copy_probe"
)

// copyKernels lists the copy kernels of kernels.cu, in the order error
// messages name them, each with how it throttles device-to-host stores
// every FenceBytes ("fence", "read-back"), or "" for a kernel that does not
// take the throttle arguments (fence interval and pace).
var copyKernels = []struct {
	name     string
	throttle string
}{
	{DefaultCopyKernel, ""},
	{StreamingCopyKernel, ""},
	{SysFenceCopyKernel, "fence"},
	{ProbeCopyKernel, "read-back"},
}

// copyKernel reports whether name is a copy kernel and how it throttles
// ("" where FenceBytes and PaceGBps do not apply to it).
func copyKernel(name string) (known bool, throttle string) {
	for _, k := range copyKernels {
		if k.name == name {
			return true, k.throttle
		}
	}
	return false, ""
}

// Throttled reports whether the kernel takes kvo_copy_sys's fence interval
// and pace (Options.FenceBytes and PaceGBps).
func (l Launch) Throttled() bool {
	_, t := copyKernel(l.Kernel)
	return t != ""
}

func copyKernelNames() string {
	names := make([]string, len(copyKernels))
	for i, k := range copyKernels {
		names[i] = fmt.Sprintf("%q", k.name)
	}
	return strings.Join(names, ", ")
}

// FenceUnit is what one warp copies per loop iteration of the copy kernels
// (32 lanes × 8 loads of 16 bytes): the throttled kernels count their
// fence interval in these.
const FenceUnit = 4096

// DefaultFenceBytes is the fence (or read-back) interval of a throttled
// kernel's launch that Options.CopyKernel asks for without FenceBytes.
const DefaultFenceBytes = FenceUnit

// SmallSegmentFenceBytes is the read-back interval that kvo_copy_probe
// takes, where Options leave FenceBytes unset, for a D2H batch whose
// segments average less than it. With segments that small, reading back
// after every segment costs rate and varies from machine to machine;
// every two segments is steadier and slows the model's kernels no more.
// With larger segments the longer interval gains little rate and slows
// them more, so it is kept for small segments only.
const SmallSegmentFenceBytes = 2 * FenceUnit

// fenceBytes is the fence or read-back interval of launch l for a D2H
// batch of segs: l's, or SmallSegmentFenceBytes for small segments (see
// there).
func (c *Copier) fenceBytes(l Launch, segs []Segment) int {
	if c.opts.FenceBytes != 0 || l.Kernel != ProbeCopyKernel || l.FenceBytes >= SmallSegmentFenceBytes ||
		len(segs) == 0 || segBytes(segs)/uint64(len(segs)) >= SmallSegmentFenceBytes {
		return l.FenceBytes
	}
	return SmallSegmentFenceBytes
}

// paceNs is the throttled kernels' pace_ns: the time one warp's 4 KiB iteration
// takes at its share of gbps among warps warps (GB/s is bytes per ns); 0
// without pacing.
func paceNs(gbps float64, warps int) uint64 {
	if gbps <= 0 || warps <= 0 {
		return 0
	}
	return uint64(math.Round(FenceUnit * float64(warps) / gbps))
}
