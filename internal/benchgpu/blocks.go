package benchgpu

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
)

// BlocksConfig says what MeasureBlocks measures: stores, loads, and both at
// once, of whole KV blocks in the layer-separate layout, where a block's
// segments come from different device tensors and lie back to back in its
// host slot, as the offload engine copies them.
type BlocksConfig struct {
	// TotalBytes per direction per run (default 2 GiB).
	TotalBytes uint64 `json:"total_bytes"`
	// SegSizes are the segment (one layer's K or V of one block) sizes
	// (default 4, 16 and 32 KiB).
	SegSizes []uint64 `json:"seg_sizes"`
	// SegsPerBlock is 2 × layers (default 32: 16 layers).
	SegsPerBlock int `json:"segs_per_block"`
	// Reps timed per point (default 3).
	Reps int `json:"reps"`
	// BurnN is kvo_sgemm's size for the pass beside it (default 4096; -1
	// skips it).
	BurnN int    `json:"burn_n"`
	Seed  uint64 `json:"seed"`
	// PTX replaces the embedded kernels.ptx.
	PTX []byte `json:"-"`
}

func (c BlocksConfig) withDefaults() BlocksConfig {
	if c.TotalBytes == 0 {
		c.TotalBytes = 2 << 30
	}
	if len(c.SegSizes) == 0 {
		c.SegSizes = []uint64{4 << 10, 16 << 10, 32 << 10}
	}
	if c.SegsPerBlock == 0 {
		c.SegsPerBlock = 32
	}
	if c.Reps == 0 {
		c.Reps = 3
	}
	if c.BurnN == 0 {
		c.BurnN = 4096
	}
	return c
}

// BlocksRow is one method at one segment size. GB/s are gated GPU rates
// (see ThroughputRow.GBps); "both" moves TotalBytes each way. Beside* are
// the store alone beside kvo_sgemm.
type BlocksRow struct {
	Method     string  `json:"method"`
	SegBytes   uint64  `json:"seg_bytes"`
	BlockBytes uint64  `json:"block_bytes"`
	D2HGBps    float64 `json:"d2h_gbps"`
	D2HPct     float64 `json:"d2h_pct_of_link"`
	H2DGBps    float64 `json:"h2d_gbps"`
	H2DPct     float64 `json:"h2d_pct_of_link"`
	BothGBps   float64 `json:"both_gbps"`
	BothPct    float64 `json:"both_pct_of_link"`
	// BesideGBps, BesidePctOfSolo and SlowdownPct: the store beside the
	// matrix product (0 when the burn pass was skipped).
	BesideGBps      float64 `json:"beside_gbps,omitempty"`
	BesidePctOfSolo float64 `json:"beside_pct_of_solo,omitempty"`
	SlowdownPct     float64 `json:"sgemm_slowdown_pct,omitempty"`
	Gated           bool    `json:"gated"`
}

// BlocksResults is everything MeasureBlocks measured.
type BlocksResults struct {
	Config BlocksConfig       `json:"config"`
	Link   map[string]float64 `json:"link_gbps"`
	SGEMM  SGEMMInfo          `json:"sgemm"`
	Rows   []BlocksRow        `json:"rows"`
	// Invalid lists the rows above MaxPctOfLink of their direction's link
	// reference (BlocksVerdict): a reference a row beats is broken, and
	// the run reports no figure against it.
	Invalid []string `json:"invalid,omitempty"`
}

// BlocksVerdict lists every rate of rows above MaxPctOfLink percent of its
// link reference, or with no reference, as LinkVerdict does for the
// throughput rows.
func BlocksVerdict(link map[string]float64, rows []BlocksRow) []string {
	var bad []string
	for _, row := range rows {
		for _, d := range []struct {
			dir  string
			gbps float64
		}{{"d2h", row.D2HGBps}, {"h2d", row.H2DGBps}, {"both", row.BothGBps}} {
			name := fmt.Sprintf("%s %s %s", row.Method, d.dir, cudacopy.FormatBytes(row.SegBytes))
			switch l := link[d.dir]; {
			case l <= 0:
				bad = append(bad, fmt.Sprintf("%s: no %s link reference", name, d.dir))
			case 100*d.gbps/l > MaxPctOfLink:
				bad = append(bad, fmt.Sprintf("%s: %.1f GB/s = %.1f%% of the link (%.1f GB/s), above %d%%", name, d.gbps, 100*d.gbps/l, l, MaxPctOfLink))
			}
		}
	}
	return bad
}

// blockSegs is one segment size's stores (devA → hostA) and loads (hostB →
// devB) of whole blocks at random host slots and device rows.
func (b *bench) blockSegs(size uint64, per int, seed uint64) (d2h, h2d []cudacopy.Segment) {
	n := int(b.cfg.TotalBytes / (size * uint64(per)))
	rng := rand.New(rand.NewPCG(seed, size))
	hp, dp := rng.Perm(n), rng.Perm(n)
	slot := size * uint64(per)
	for blk := range n {
		for k := range per {
			h := uint64(hp[blk])*slot + uint64(k)*size
			d := (uint64(k)*uint64(n) + uint64(dp[blk])) * size
			d2h = append(d2h, cudacopy.Segment{Dst: b.hostA.addr() + h, Src: uint64(b.devA) + d, Len: size})
			h2d = append(h2d, cudacopy.Segment{Dst: uint64(b.devB) + d, Src: b.hostB.addr() + h, Len: size})
		}
	}
	return d2h, h2d
}

// blockMethod is one way of storing and loading blocks.
type blockMethod struct {
	name string
	c    *cudacopy.Copier
	// staged: SubmitGather and SubmitScatter always; auto: what the engine
	// does (SubmitGather when Gatherable, SubmitScatter when Scatterable,
	// else Submit).
	staged, auto bool
}

// MeasureBlocks compares the ways of storing and loading whole blocks: the
// copy kernel at its default launches, with unthrottled stores on 8 × 1024,
// the batch API, staged copies (SubmitGather / SubmitScatter: one DMA per
// block between host and device staging, the kernel on the device side),
// and what the engine does (SubmitGather when Gatherable, SubmitScatter when
// Scatterable, else the automatic choice), against the contiguous
// link measured in the same
// call: stores alone, loads alone, both at once, and stores beside
// kvo_sgemm. The calling goroutine must be locked to an OS thread with
// dev's context current.
func MeasureBlocks(drv cuda.Driver, dev cuda.Device, cfg BlocksConfig) (res BlocksResults, err error) {
	cfg = cfg.withDefaults()
	res.Config = cfg
	if cfg.SegsPerBlock < 1 || cfg.Reps < 1 {
		return res, fmt.Errorf("bench: SegsPerBlock %d and Reps %d must be positive", cfg.SegsPerBlock, cfg.Reps)
	}
	for _, s := range cfg.SegSizes {
		if s == 0 || s%16 != 0 || cfg.TotalBytes/(s*uint64(cfg.SegsPerBlock)) < 2 {
			return res, fmt.Errorf("bench: segment size %d must be a multiple of 16 with at least 2 blocks of %d segments in %d bytes", s, cfg.SegsPerBlock, cfg.TotalBytes)
		}
	}
	tc := ThroughputConfig{TotalBytes: cfg.TotalBytes, SegSizes: cfg.SegSizes, Reps: cfg.Reps, BurnN: max(cfg.BurnN, 64), Seed: cfg.Seed, PTX: cfg.PTX, CTAs: []int{1}}.withDefaults()
	b := &bench{drv: drv, cfg: tc}
	defer func() { err = errors.Join(err, b.close()) }()
	if err := b.setupBase(); err != nil {
		return res, err
	}
	least, greatest, err := drv.StreamPriorityRange()
	if err != nil {
		return res, err
	}
	// gather, scatter: as cudadev.CUDA's staging streams, at the priority
	// of their direction's stream.
	var aux [2]cuda.Stream
	for i, prio := range []int{least, greatest} {
		if aux[i], err = drv.StreamCreate(cuda.StreamNonBlocking, prio); err != nil {
			return res, err
		}
		st := aux[i]
		b.onClose(func() error { return drv.StreamDestroy(st) })
	}
	tr := ThroughputResults{Link: map[string]float64{}}
	if err := b.link(&tr); err != nil {
		return res, err
	}
	res.Link = tr.Link
	var methods []*blockMethod
	for _, m := range []struct {
		name string
		o    cudacopy.Options
	}{
		{"kernel", cudacopy.Options{Method: cudacopy.MethodKernel}},
		{"kernel/8", cudacopy.Options{Method: cudacopy.MethodKernel, GreedyD2H: true}},
		{"batch", cudacopy.Options{Method: cudacopy.MethodBatch}},
		{"staged", cudacopy.Options{}},
		{"auto", cudacopy.Options{}},
	} {
		if m.name == "batch" && !drv.HasMemcpyBatch() {
			continue
		}
		c, err := b.newCopier(dev, m.o)
		if err != nil {
			return res, fmt.Errorf("bench: copier %s: %w", m.name, err)
		}
		b.onClose(c.Close)
		methods = append(methods, &blockMethod{name: m.name, c: c, staged: m.name == "staged", auto: m.name == "auto"})
	}
	if _, err := methods[len(methods)-1].c.Calibrate(b.s[0]); err != nil {
		return res, fmt.Errorf("bench: calibration: %w", err)
	}
	var gm *gemm
	if cfg.BurnN > 0 {
		if gm, res.SGEMM, err = b.soloGemm(); err != nil {
			return res, err
		}
	} else {
		res.SGEMM.Skipped = "disabled (BurnN < 0)"
	}
	for _, size := range cfg.SegSizes {
		d2h, h2d := b.blockSegs(size, cfg.SegsPerBlock, cfg.Seed)
		for _, m := range methods {
			row, err := b.blockRow(m, aux, gm, res, size, d2h, h2d)
			if err != nil {
				return res, fmt.Errorf("bench: blocks %s at %s: %w", m.name, cudacopy.FormatBytes(size), err)
			}
			res.Rows = append(res.Rows, row)
		}
	}
	res.Invalid = BlocksVerdict(res.Link, res.Rows)
	return res, nil
}

func (b *bench) blockRow(m *blockMethod, aux [2]cuda.Stream, gm *gemm, res BlocksResults, size uint64, d2h, h2d []cudacopy.Segment) (BlocksRow, error) {
	store := func(t *[]tk) error {
		var x cudacopy.Ticket
		var err error
		if m.staged || (m.auto && m.c.Gatherable(d2h)) {
			// As cudadev.CUDA does: the staging stream waits for what the
			// store stream waits for (here the run's start event).
			if err = b.drv.StreamWaitEvent(aux[0], b.ev[0], 0); err == nil {
				x, err = m.c.SubmitGather(aux[0], b.s[0], d2h)
			}
		} else {
			x, err = m.c.Submit(b.s[0], cudacopy.D2H, d2h)
		}
		if err != nil {
			return err
		}
		*t = append(*t, tk{m.c, x})
		return nil
	}
	load := func(t *[]tk) error {
		var x cudacopy.Ticket
		var err error
		if m.staged || (m.auto && m.c.Scatterable(h2d)) {
			if err = b.drv.StreamWaitEvent(aux[1], b.ev[0], 0); err == nil {
				x, err = m.c.SubmitScatter(b.s[1], aux[1], h2d)
			}
		} else {
			x, err = m.c.Submit(b.s[1], cudacopy.H2D, h2d)
		}
		if err != nil {
			return err
		}
		*t = append(*t, tk{m.c, x})
		return nil
	}
	both := func(t *[]tk) error {
		if err := store(t); err != nil {
			return err
		}
		return load(t)
	}
	row := BlocksRow{Method: m.name, SegBytes: size, BlockBytes: size * uint64(res.Config.SegsPerBlock)}
	n := res.Config.TotalBytes
	solo, err := b.reps(store, true)
	if err != nil {
		return row, err
	}
	lt, err := b.reps(load, true)
	if err != nil {
		return row, err
	}
	bt, err := b.reps(both, true)
	if err != nil {
		return row, err
	}
	row.D2HGBps, row.H2DGBps, row.BothGBps = gbps(n, solo.best), gbps(n, lt.best), gbps(2*n, bt.best)
	row.D2HPct = 100 * row.D2HGBps / max(res.Link["d2h"], 1e-9)
	row.H2DPct = 100 * row.H2DGBps / max(res.Link["h2d"], 1e-9)
	row.BothPct = 100 * row.BothGBps / max(res.Link["both"], 1e-9)
	row.Gated = solo.held && lt.held && bt.held
	if gm != nil {
		tm, slow, err := b.besideGemm(gm, res.SGEMM.SoloMs, solo, store)
		if err != nil {
			return row, err
		}
		row.BesideGBps = gbps(n, tm.best)
		row.BesidePctOfSolo = 100 * row.BesideGBps / max(row.D2HGBps, 1e-9)
		row.SlowdownPct = slow
	}
	return row, nil
}

// FormatBlocks renders the results as one markdown table.
func FormatBlocks(r BlocksResults) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Stores and loads of whole layer-separate blocks (%d segments each, back to back in a host slot, from %d device tensors), %s per direction per run at random slots, best of %d gated runs († where a gate did not hold). Link: d2h %.1f GB/s, h2d %.1f GB/s, both %.1f GB/s. ",
		r.Config.SegsPerBlock, r.Config.SegsPerBlock, cudacopy.FormatBytes(r.Config.TotalBytes), r.Config.Reps, r.Link["d2h"], r.Link["h2d"], r.Link["both"])
	if len(r.Invalid) > 0 {
		fmt.Fprintf(&b, "\n\n**INVALID**: rates above %d%% of their link reference, so the reference is broken and no figure here stands:\n\n", MaxPctOfLink)
		for _, x := range r.Invalid {
			fmt.Fprintf(&b, "- %s\n", x)
		}
		b.WriteString("\n")
	}
	if r.SGEMM.Skipped != "" {
		fmt.Fprintf(&b, "sgemm skipped: %s.\n\n", r.SGEMM.Skipped)
	} else {
		fmt.Fprintf(&b, "kvo_sgemm n=%d alone: %.2f ms.\n\n", r.SGEMM.N, r.SGEMM.SoloMs)
	}
	b.WriteString("| segment | block | method | d2h GB/s | h2d GB/s | both GB/s | d2h beside sgemm | sgemm slowdown |\n|---|---|---|---:|---:|---:|---:|---:|\n")
	for _, row := range r.Rows {
		mark := ""
		if !row.Gated {
			mark = "†"
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %.1f (%.0f%%)%s | %.1f (%.0f%%)%s | %.1f (%.0f%%)%s |", cudacopy.FormatBytes(row.SegBytes), cudacopy.FormatBytes(row.BlockBytes), row.Method,
			row.D2HGBps, row.D2HPct, mark, row.H2DGBps, row.H2DPct, mark, row.BothGBps, row.BothPct, mark)
		if r.SGEMM.Skipped == "" {
			fmt.Fprintf(&b, " %.1f (%.0f%% of solo) | %+.1f%% |\n", row.BesideGBps, row.BesidePctOfSolo, row.SlowdownPct)
		} else {
			b.WriteString(" – | – |\n")
		}
	}
	return b.String()
}
