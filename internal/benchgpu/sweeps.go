package benchgpu

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
)

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
// (PaceGBps) is left out: it did not lower the matrix product's slowdown
// at a given D2H rate.
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
// default D2H launch (run by scripts/gpu/run.sh sweep:probe).
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
