package cudacopy

import (
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"
)

// Measurement is one calibrated rate: a batch of segments of SegBytes each,
// at random slots on both sides, copied in Dir by Method at GBps.
type Measurement struct {
	Dir      Path    `json:"dir"`
	Method   Method  `json:"method"`
	SegBytes uint64  `json:"seg_bytes"`
	GBps     float64 `json:"gbps"`
}

// Calibration is the table Choose picks methods from. It is plain data:
// Calibrate measures it, Options.Calibration or SetCalibration loads a saved
// one (it marshals to JSON).
type Calibration struct {
	// Device names the GPU it was calibrated on (informational).
	Device string `json:"device,omitempty"`
	// D2H and H2D are the kernel launches the kernel rows were timed
	// with.
	D2H Launch `json:"d2h_launch"`
	H2D Launch `json:"h2d_launch"`
	// TotalBytes is the size of the buffers the timed segments lie in.
	TotalBytes uint64 `json:"total_bytes,omitempty"`
	// PieceBytes and Pieces: each rate is that of up to Pieces
	// back-to-back Submits of up to PieceBytes each, after a lead Submit
	// (see CalibrationConfig).
	PieceBytes uint64        `json:"piece_bytes,omitempty"`
	Pieces     int           `json:"pieces,omitempty"`
	Entries    []Measurement `json:"entries"`
}

// Validate checks that every entry names a real direction and a concrete
// method with a positive size and a finite, non-negative rate.
func (c *Calibration) Validate() error {
	for i, e := range c.Entries {
		switch {
		case !e.Dir.valid():
			return fmt.Errorf("%w: calibration entry %d: direction %d", ErrInvalidOption, i, int(e.Dir))
		case e.Method <= MethodAuto || !e.Method.valid():
			return fmt.Errorf("%w: calibration entry %d: method %v is not a concrete method", ErrInvalidOption, i, e.Method)
		case e.SegBytes == 0:
			return fmt.Errorf("%w: calibration entry %d: zero segment size", ErrInvalidOption, i)
		case math.IsNaN(e.GBps) || math.IsInf(e.GBps, 0) || e.GBps < 0:
			return fmt.Errorf("%w: calibration entry %d: rate %v GB/s", ErrInvalidOption, i, e.GBps)
		}
	}
	return nil
}

// Markdown renders the table: one row per direction and segment size, one
// column per method, and the method Choose takes there with every method
// available and DefaultDMAMargin.
func (c *Calibration) Markdown() string {
	type key struct {
		dir  Path
		size uint64
	}
	rates := map[key]map[Method]float64{}
	var keys []key
	var methods []Method
	for _, e := range c.Entries {
		k := key{e.Dir, e.SegBytes}
		if rates[k] == nil {
			rates[k] = map[Method]float64{}
			keys = append(keys, k)
		}
		rates[k][e.Method] = e.GBps
		if !slices.Contains(methods, e.Method) {
			methods = append(methods, e.Method)
		}
	}
	slices.Sort(methods)
	sort.Slice(keys, func(i, j int) bool {
		if keys[i].dir != keys[j].dir {
			return keys[i].dir < keys[j].dir
		}
		return keys[i].size < keys[j].size
	})
	var b strings.Builder
	b.WriteString("| dir | segment |")
	for _, m := range methods {
		fmt.Fprintf(&b, " %s GB/s |", m)
	}
	b.WriteString(" chosen |\n|---|---|")
	for range methods {
		b.WriteString("---|")
	}
	b.WriteString("---|\n")
	ch := newChooser(c, true, true, DefaultDMAMargin)
	for _, k := range keys {
		fmt.Fprintf(&b, "| %s | %s |", k.dir, FormatBytes(k.size))
		for _, m := range methods {
			if r, ok := rates[k][m]; ok {
				fmt.Fprintf(&b, " %.1f |", r)
			} else {
				b.WriteString(" – |")
			}
		}
		fmt.Fprintf(&b, " %s |\n", ch.choose(k.dir, 2, 2*k.size, true))
	}
	return b.String()
}

// FormatBytes writes n as "4 KiB", "2 MiB", "1.5 GiB" or "100 B".
func FormatBytes(n uint64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB"}
	v := float64(n)
	u := 0
	for v >= 1024 && u < len(units)-1 {
		v /= 1024
		u++
	}
	if v == math.Trunc(v) {
		return fmt.Sprintf("%d %s", int64(v), units[u])
	}
	return fmt.Sprintf("%.1f %s", v, units[u])
}

// point is one calibrated (log2 size, rate) pair.
type point struct {
	logSize, gbps float64
}

// Margins by which Choose prefers a DMA method (the batch API, else
// memcpy) to the copy kernel; see Options.DMAMargin.
//
// The DMA engines leave the SMs to the model; the kernel takes a few and
// slows the model's kernels beside it, a little at the default launches
// (DefaultLaunch), much more unthrottled. The batch API leaves them
// untouched at every segment size. So a few percent of copy rate is worth
// giving up to leave the SMs alone.
const (
	// DefaultDMAMargin: a DMA method within 3% of the kernel's rate is
	// taken; about the run-to-run noise of a calibration point.
	DefaultDMAMargin = 0.03
	// PreferDMAMargin (Options.PreferDMA): within 15%, for serving stacks
	// whose kernels need every SM (typically it takes the batch API for
	// medium and large segments in both directions).
	PreferDMAMargin = 0.15
)

// chooser holds the calibration as per-direction, per-method curves sorted
// by size, so that choose allocates nothing.
type chooser struct {
	curves    [D2D + 1][MethodKernel + 1][]point
	hasBatch  bool
	hasKern   bool
	dmaMargin float64
}

func newChooser(c *Calibration, hasBatch, hasKernel bool, dmaMargin float64) *chooser {
	ch := &chooser{hasBatch: hasBatch, hasKern: hasKernel, dmaMargin: dmaMargin}
	if c == nil {
		return ch
	}
	for _, e := range c.Entries {
		if !e.Dir.valid() || e.Method <= MethodAuto || !e.Method.valid() || e.SegBytes == 0 {
			continue
		}
		pts := ch.curves[e.Dir][e.Method]
		ls := math.Log2(float64(e.SegBytes))
		if j := slices.IndexFunc(pts, func(p point) bool { return p.logSize == ls }); j >= 0 {
			pts[j].gbps = max(pts[j].gbps, e.GBps)
			continue
		}
		ch.curves[e.Dir][e.Method] = append(pts, point{ls, e.GBps})
	}
	for d := range ch.curves {
		for m := range ch.curves[d] {
			slices.SortFunc(ch.curves[d][m], func(a, b point) int { return cmpFloat(a.logSize, b.logSize) })
		}
	}
	return ch
}

func cmpFloat(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// rate interpolates a curve linearly in log2(size), clamped at its ends;
// ok is false for an empty curve.
func rate(pts []point, size float64) (float64, bool) {
	if len(pts) == 0 {
		return 0, false
	}
	ls := math.Log2(size)
	if ls <= pts[0].logSize {
		return pts[0].gbps, true
	}
	last := pts[len(pts)-1]
	if ls >= last.logSize {
		return last.gbps, true
	}
	j := sort.Search(len(pts), func(i int) bool { return pts[i].logSize >= ls })
	a, b := pts[j-1], pts[j]
	f := (ls - a.logSize) / (b.logSize - a.logSize)
	return a.gbps + f*(b.gbps-a.gbps), true
}

// choose picks a method for n segments of total bytes; kernelOK says the
// batch meets the kernel's alignment.
//
// Rules, in order:
//   - one segment: memcpy (one driver call; every other method needs one or
//     two plus their own work);
//   - with calibration curves for the direction, interpolated at the
//     batch's mean segment size: the faster available DMA method (memcpy on
//     a tie) if its rate is at least (1 - dmaMargin) of the kernel's or the
//     kernel is unavailable or uncalibrated, else the kernel;
//   - without: kernel, else batch, else memcpy (fastest first for
//     scattered segments of 4 KiB–2 MiB, doc/ANCHORS.md).
func (ch *chooser) choose(dir Path, n int, total uint64, kernelOK bool) Method {
	return ch.choosePieces(dir, n, n, total, kernelOK)
}

// choosePieces is choose for a batch the DMA methods copy as dmaN pieces
// and the kernel as kernN descriptors (they differ for strided segments:
// one DMA copy per row, one kernel descriptor per segment). Each method's
// rate is read at its own mean piece size; below a DMA curve's smallest
// point the rate falls in proportion to the size (a DMA copy's cost is
// then its per-copy overhead), where rate would hold it at the smallest
// point's.
func (ch *chooser) choosePieces(dir Path, dmaN, kernN int, total uint64, kernelOK bool) Method {
	if dmaN <= 1 && kernN <= 1 {
		return MethodMemcpy
	}
	avail := [MethodKernel + 1]bool{MethodMemcpy: true, MethodBatch: ch.hasBatch, MethodKernel: ch.hasKern && kernelOK}
	if dir.valid() {
		size := float64(total) / float64(max(dmaN, 1))
		dma, dmaRate := MethodAuto, -1.0
		for _, m := range [...]Method{MethodMemcpy, MethodBatch} {
			r, ok := rate(ch.curves[dir][m], size)
			if pts := ch.curves[dir][m]; ok && math.Log2(size) < pts[0].logSize {
				r *= size / math.Exp2(pts[0].logSize)
			}
			if ok && avail[m] && r > dmaRate {
				dma, dmaRate = m, r
			}
		}
		kernRate, kernOK := rate(ch.curves[dir][MethodKernel], float64(total)/float64(max(kernN, 1)))
		kernOK = kernOK && avail[MethodKernel]
		switch {
		case kernOK && (dma == MethodAuto || dmaRate < (1-ch.dmaMargin)*kernRate):
			return MethodKernel
		case dma != MethodAuto:
			return dma
		}
	}
	for _, m := range [...]Method{MethodKernel, MethodBatch} {
		if avail[m] {
			return m
		}
	}
	return MethodMemcpy
}
