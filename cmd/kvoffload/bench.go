package main

import (
	"context"
	"encoding/csv"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/kvoffload/kvoffload/bench"
	"github.com/kvoffload/kvoffload/internal/benchgpu"
	"github.com/kvoffload/kvoffload/internal/cuda"
)

var benchCommand = command{
	name:    "bench",
	summary: "Measure the copy methods against the link, and the ways of getting pinned memory (needs a GPU).",
	details: `Runs the transfer sweep (scattered segments at random slots on both sides, every
method and kernel grid size, each direction and both at once, then beside a
matrix product) and the pinning comparison (mmap + parallel prefault +
cuMemHostRegister against cuMemHostAlloc), and writes into --out:

  throughput.csv, pinning.csv   one line per measured point
  summary.json                  the machine, the configuration and every result
  throughput-<dir>.svg          GB/s against segment size, one line per method,
                                the link as a dashed line (dir: d2h, h2d, both)
  results.md                    the tables printed on stdout

The link reference (one contiguous copy each way and both ways at once) is
measured after a warm-up, before and after the rows, and the faster is kept.
A row above 102% of it makes the run INVALID: the tables say so instead of
reporting targets, summary.json has "valid": false, and the exit status is 3.

Without a GPU it exits with status 1 and says why.`,
	flags: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
		cfg := benchgpu.DefaultThroughputConfig()
		out := fs.String("out", "kvoffload-bench", "output `dir` (created)")
		total := int64(cfg.TotalBytes)
		fs.Var(sizeFlag{&total}, "total-bytes", "bytes moved per direction in every timed run, a `size`")
		segs := sizeList(u64s[uint64, int64](cfg.SegSizes))
		fs.Var(&segs, "seg-sizes", "segment `sizes`, comma-separated (4KiB,16KiB,...)")
		ctas := intList(cfg.CTAs)
		fs.Var(&ctas, "ctas", "copy-kernel grid `sizes`, comma-separated")
		fs.IntVar(&cfg.Reps, "reps", cfg.Reps, "timed repetitions per point, `n` (best and median reported)")
		fs.BoolVar(&cfg.NoBurn, "no-burn", false, "skip the pass beside a matrix product")
		pools := sizeList{1 << 30, 5 << 30, 17 << 30, 48 << 30}
		fs.Var(&pools, "pool-sizes", "pinned pool `sizes` for the pinning comparison, comma-separated")
		skipHostAlloc := fs.Bool("skip-hostalloc", false, "leave out the cuMemHostAlloc reference")
		only := fs.String("only", "all", "what to measure: all|throughput|pinning")
		device := fs.Int("device", 0, "CUDA device ordinal `n`")
		fs.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "`seed` of the random slot permutations")
		asJSON := fs.Bool("json", false, "print the JSON summary instead of the tables")
		ptx := fs.String("ptx", "", "copy kernels from this PTX `file` instead of the embedded one (one built on the GPU machine)")
		return func(_ context.Context, e *env, args []string) error {
			if err := noArgs(args); err != nil {
				return err
			}
			if *ptx != "" {
				img, err := os.ReadFile(*ptx)
				switch {
				case err != nil:
					return fmt.Errorf("%w: --ptx: %w", errUsage, err)
				case len(img) == 0:
					return fmt.Errorf("%w: --ptx %s is empty", errUsage, *ptx)
				}
				cfg.PTX = img
			}
			switch {
			case *only != "all" && *only != "throughput" && *only != "pinning":
				return fmt.Errorf("%w: --only %q must be all, throughput or pinning", errUsage, *only)
			case *device < 0:
				return fmt.Errorf("%w: --device %d must not be negative", errUsage, *device)
			case cfg.Reps < 1:
				return fmt.Errorf("%w: --reps %d must be at least 1", errUsage, cfg.Reps)
			case total <= 0:
				return fmt.Errorf("%w: --total-bytes %d must be positive", errUsage, total)
			}
			cfg.TotalBytes, cfg.SegSizes, cfg.CTAs = uint64(total), u64s[int64, uint64](segs), []int(ctas)
			cfg.Command = commandLine("bench", fs)
			b := benchRun{cfg: cfg, pools: pools, skipHostAlloc: *skipHostAlloc, only: *only, device: *device, out: *out}
			return b.run(e, *asJSON)
		}
	},
}

// benchRun is one `kvoffload bench`.
type benchRun struct {
	cfg           benchgpu.ThroughputConfig
	pools         []int64
	skipHostAlloc bool
	only          string
	device        int
	out           string
}

// benchSummary is summary.json.
type benchSummary struct {
	Command    string                      `json:"command"`
	Started    time.Time                   `json:"started"`
	Machine    machineInfo                 `json:"machine"`
	Throughput *benchgpu.ThroughputResults `json:"throughput,omitempty"`
	Pinning    []pinningRow                `json:"pinning,omitempty"`
	Skipped    []string                    `json:"skipped,omitempty"`
	// Valid is false when a throughput row exceeded benchgpu.MaxPctOfLink of
	// the link (Throughput.Invalid says which): no target is reported.
	Valid bool `json:"valid"`
}

// verdict sets s.Valid from the throughput rows' check against the link
// (benchgpu.LinkVerdict, done by MeasureThroughput) and returns an
// errVerification error for an invalid run.
func (s *benchSummary) verdict() error {
	s.Valid = s.Throughput == nil || len(s.Throughput.Invalid) == 0
	if s.Valid {
		return nil
	}
	return fmt.Errorf("%w: the throughput run is INVALID: %d row(s) above %d%% of the link reference (first: %s)",
		errVerification, len(s.Throughput.Invalid), benchgpu.MaxPctOfLink, s.Throughput.Invalid[0])
}

// pinningRow is a benchgpu.PinningResult in seconds and bytes, for JSON and CSV.
type pinningRow struct {
	SizeBytes        int64   `json:"size_bytes"`
	MapSeconds       float64 `json:"map_s"`
	RegisterSeconds  float64 `json:"register_s"`
	TotalSeconds     float64 `json:"total_s"`
	GiBps            float64 `json:"gib_per_s"`
	MappedBytes      int64   `json:"mapped_bytes"`
	ExtraBytes       int64   `json:"extra_bytes"`
	PageBytes        int64   `json:"page_bytes"`
	Ranges           int     `json:"ranges"`
	Threads          int     `json:"threads"`
	Fallback         string  `json:"fallback,omitempty"`
	HostAllocSeconds float64 `json:"hostalloc_s"`
	HostAllocFreeSec float64 `json:"hostalloc_free_s"`
	HostAllocGiBps   float64 `json:"hostalloc_gib_per_s"`
	Speedup          float64 `json:"speedup"`
	// The first (cold) run at this size, before cuMemHostAlloc: see
	// benchgpu.PinningResult.Cold.
	ColdMapSeconds      float64 `json:"cold_map_s"`
	ColdRegisterSeconds float64 `json:"cold_register_s"`
	ColdTotalSeconds    float64 `json:"cold_total_s"`
	ColdGiBps           float64 `json:"cold_gib_per_s"`
	ColdSpeedup         float64 `json:"cold_speedup"`
	// ChunkBytes is the pipelined-registration chunk; 0 when sequential.
	ChunkBytes int64 `json:"chunk_bytes"`
}

func toPinningRows(rs []benchgpu.PinningResult) []pinningRow {
	out := make([]pinningRow, len(rs))
	for i, r := range rs {
		out[i] = pinningRow{SizeBytes: r.Size, MapSeconds: r.Map.Seconds(), RegisterSeconds: r.Register.Seconds(),
			TotalSeconds: r.Total.Seconds(), GiBps: r.GiBps, MappedBytes: r.Mapped, ExtraBytes: r.Extra(), PageBytes: r.PageSize,
			Ranges: r.Ranges, Threads: r.Threads, Fallback: r.Fallback, HostAllocSeconds: r.HostAlloc.Seconds(),
			HostAllocFreeSec: r.HostAllocFree.Seconds(), HostAllocGiBps: r.HostAllocGiBs, Speedup: r.Speedup,
			ColdMapSeconds: r.Cold.Map.Seconds(), ColdRegisterSeconds: r.Cold.Register.Seconds(),
			ColdTotalSeconds: r.Cold.Total.Seconds(), ColdGiBps: r.Cold.GiBps, ColdSpeedup: r.ColdSpeedup, ChunkBytes: r.Chunk}
	}
	return out
}

func (b benchRun) run(e *env, asJSON bool) error {
	drv, err := cuda.Load()
	if err != nil {
		return fmt.Errorf("needs a CUDA GPU (run kvoffload info to see why there is none): %w", err)
	}
	n, err := drv.DeviceCount()
	if err != nil {
		return fmt.Errorf("needs a CUDA GPU: counting devices: %w", err)
	}
	if b.device >= n {
		return fmt.Errorf("--device %d asked for, the driver sees %d device(s)", b.device, n)
	}
	dev, err := drv.DeviceGet(b.device)
	if err != nil {
		return fmt.Errorf("device %d: %w", b.device, err)
	}
	if err := os.MkdirAll(b.out, 0o755); err != nil {
		return fmt.Errorf("--out: %w", err)
	}
	sum := benchSummary{Command: b.cfg.Command, Started: time.Now().UTC(), Machine: defaultProber().collect(b.device)}
	// Spinners on the passes (on a terminal, without --json).
	var progress io.Writer
	if e.stderrIsTTY && !asJSON {
		progress = e.stderr
	}
	var runErr error
	if b.only != "pinning" {
		fmt.Fprintln(e.stderr, "kvoffload bench: measuring throughput (a few minutes)...")
		sp := startStep(progress, "throughput")
		res, err := b.throughput(drv, dev)
		sp.end()
		if err != nil {
			runErr = fmt.Errorf("throughput: %w", err)
		} else {
			sum.Throughput = &res
		}
	}
	if b.only != "throughput" && runErr == nil {
		sizes, skipped := b.pinningSizes(sum.Machine.Host.MemAvailableBytes)
		sum.Skipped = skipped
		for _, s := range skipped {
			fmt.Fprintln(e.stderr, "kvoffload bench: "+s)
		}
		if len(sizes) > 0 {
			fmt.Fprintln(e.stderr, "kvoffload bench: measuring pinning...")
			sp := startStep(progress, "pinning")
			rs, err := benchgpu.MeasurePinning(drv, dev, sizes, benchgpu.PinningOptions{SkipHostAlloc: b.skipHostAlloc})
			sp.end()
			sum.Pinning = toPinningRows(rs)
			if err != nil {
				runErr = fmt.Errorf("pinning: %w", err)
			}
		}
	}
	runErr = errors.Join(runErr, sum.verdict())
	files, err := writeBenchFiles(b.out, sum)
	if err != nil {
		return errors.Join(runErr, err)
	}
	if asJSON {
		err = writeJSON(e.stdout, sum)
	} else {
		_, err = io.WriteString(e.stdout, benchMarkdown(sum)+"\nWrote "+strings.Join(files, ", ")+"\n")
	}
	return errors.Join(runErr, err)
}

// throughput runs the sweep on a locked thread with the device's primary
// context current.
func (b benchRun) throughput(drv cuda.Driver, dev cuda.Device) (res benchgpu.ThroughputResults, err error) {
	ctx, err := drv.PrimaryCtxRetain(dev)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, drv.PrimaryCtxRelease(dev)) }()
	err = cuda.OnThread(drv, ctx, func() error {
		var merr error
		res, merr = benchgpu.MeasureThroughput(drv, dev, b.cfg)
		return merr
	})
	return res, err
}

// pinningSizes drops the pool sizes the machine cannot hold (the
// comparison maps each size twice, one after the other: a size above 80%
// of MemAvailable would push the machine into reclaim or the OOM killer).
func (b benchRun) pinningSizes(avail int64) (keep []int64, skipped []string) {
	for _, s := range b.pools {
		if avail > 0 && s > avail/5*4 {
			skipped = append(skipped, fmt.Sprintf("pinning %s skipped: above 80%% of MemAvailable (%s)", formatSize(s), formatSize(avail)))
			continue
		}
		keep = append(keep, s)
	}
	return keep, skipped
}

// benchMarkdown renders the results as the tables printed and saved.
func benchMarkdown(s benchSummary) string {
	var b strings.Builder
	fmt.Fprintf(&b, "# kvoffload bench\n\nCommand: `%s`  \nStarted: %s  \n", s.Command, s.Started.Format(time.RFC3339))
	if len(s.Machine.CUDA.Devices) > 0 {
		d := s.Machine.CUDA.Devices[0]
		fmt.Fprintf(&b, "Machine: %s, PCIe gen%d x%d, driver %s (CUDA %s), %d CPUs, %s RAM, THP %s\n",
			d.Name, d.LinkGen, d.LinkWidth, s.Machine.CUDA.DriverVersion, s.Machine.CUDA.CUDAVersion,
			s.Machine.Host.CPUs, formatSize(s.Machine.Host.MemTotalBytes), s.Machine.Host.THP)
	}
	if s.Throughput != nil {
		b.WriteString("\n## Throughput\n\n")
		b.WriteString(benchgpu.FormatThroughput(*s.Throughput))
	}
	if len(s.Pinning) > 0 {
		b.WriteString("\n## Pinning\n\n")
		b.WriteString(formatPinningRows(s.Pinning))
	}
	for _, sk := range s.Skipped {
		fmt.Fprintf(&b, "\n- %s\n", sk)
	}
	return b.String()
}

// formatPinningRows renders pinning rows through benchgpu.FormatPinning.
func formatPinningRows(rows []pinningRow) string {
	rs := make([]benchgpu.PinningResult, len(rows))
	for i, r := range rows {
		rs[i] = benchgpu.PinningResult{Size: r.SizeBytes, Map: secs(r.MapSeconds), Register: secs(r.RegisterSeconds),
			Total: secs(r.TotalSeconds), GiBps: r.GiBps, Mapped: r.MappedBytes, PageSize: r.PageBytes, Ranges: r.Ranges,
			Threads: r.Threads, Fallback: r.Fallback, HostAlloc: secs(r.HostAllocSeconds), HostAllocFree: secs(r.HostAllocFreeSec),
			HostAllocGiBs: r.HostAllocGiBps, Speedup: r.Speedup, ColdSpeedup: r.ColdSpeedup, Chunk: r.ChunkBytes,
			Cold: benchgpu.PinningRun{Map: secs(r.ColdMapSeconds), Register: secs(r.ColdRegisterSeconds),
				Total: secs(r.ColdTotalSeconds), GiBps: r.ColdGiBps}}
	}
	return benchgpu.FormatPinning(rs)
}

func secs(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// writeBenchFiles writes the CSV, JSON, SVG and markdown files into dir and
// returns their names.
func writeBenchFiles(dir string, s benchSummary) ([]string, error) {
	var names []string
	write := func(name string, fn func(io.Writer) error) error {
		p := filepath.Join(dir, name)
		f, err := os.Create(p)
		if err != nil {
			return err
		}
		if err := errors.Join(fn(f), f.Close()); err != nil {
			return fmt.Errorf("writing %s: %w", p, err)
		}
		names = append(names, p)
		return nil
	}
	var errs []error
	if s.Throughput != nil {
		r := *s.Throughput
		errs = append(errs, write("throughput.csv", func(w io.Writer) error { return benchgpu.WriteThroughputCSV(w, r) }))
		for _, dir := range []string{"d2h", "h2d", "both"} {
			c := benchgpu.ThroughputChart(r, dir)
			if len(c.Series) == 0 {
				continue
			}
			errs = append(errs, write("throughput-"+dir+".svg", func(w io.Writer) error { return bench.WriteSVG(w, c) }))
		}
	}
	if len(s.Pinning) > 0 {
		errs = append(errs, write("pinning.csv", func(w io.Writer) error { return writePinningCSV(w, s.Pinning) }))
	}
	errs = append(errs, write("summary.json", func(w io.Writer) error { return writeJSON(w, s) }))
	errs = append(errs, write("results.md", func(w io.Writer) error { _, err := io.WriteString(w, benchMarkdown(s)); return err }))
	return names, errors.Join(errs...)
}

func writePinningCSV(w io.Writer, rows []pinningRow) error {
	cw := csv.NewWriter(w)
	f := func(v float64) string { return strconv.FormatFloat(v, 'f', 4, 64) }
	_ = cw.Write([]string{"size_bytes", "map_s", "register_s", "total_s", "gib_per_s", "mapped_bytes", "extra_bytes", "page_bytes",
		"ranges", "threads", "fallback", "hostalloc_s", "hostalloc_free_s", "hostalloc_gib_per_s", "speedup"})
	for _, r := range rows {
		_ = cw.Write([]string{strconv.FormatInt(r.SizeBytes, 10), f(r.MapSeconds), f(r.RegisterSeconds), f(r.TotalSeconds), f(r.GiBps),
			strconv.FormatInt(r.MappedBytes, 10), strconv.FormatInt(r.ExtraBytes, 10), strconv.FormatInt(r.PageBytes, 10),
			strconv.Itoa(r.Ranges), strconv.Itoa(r.Threads), r.Fallback, f(r.HostAllocSeconds), f(r.HostAllocFreeSec), f(r.HostAllocGiBps), f(r.Speedup)})
	}
	cw.Flush()
	return cw.Error()
}

// commandLine reconstructs the command as run, from the flags set.
func commandLine(name string, fs *flag.FlagSet) string {
	parts := []string{"kvoffload", name}
	fs.Visit(func(f *flag.Flag) { parts = append(parts, "--"+f.Name+"="+f.Value.String()) })
	return strings.Join(parts, " ")
}
