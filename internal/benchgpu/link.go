package benchgpu

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
)

// MaxPctOfLink is the most a row may reach against the contiguous link
// before the run is invalid: a scattered copy cannot beat one contiguous
// copy of the same bytes by more than measurement noise.
const MaxPctOfLink = 102

// LinkVerdict checks rows against link (GB/s by direction): one line per
// row above MaxPctOfLink of its direction's link, or per row whose
// direction has no link measured. No lines: the run is valid.
func LinkVerdict(link map[string]float64, rows []ThroughputRow) []string {
	var bad []string
	for _, row := range rows {
		if row.Method == "contiguous" {
			continue
		}
		l := link[row.Dir]
		name := fmt.Sprintf("%s %s %s (%s)", row.variant(), row.Dir, cudacopy.FormatBytes(row.SegBytes), row.Background)
		switch {
		case l <= 0:
			bad = append(bad, fmt.Sprintf("%s: no %s link reference", name, row.Dir))
		case 100*row.GBps/l > MaxPctOfLink:
			bad = append(bad, fmt.Sprintf("%s: %.1f GB/s = %.1f%% of the link (%.1f GB/s), above %d%%", name, row.GBps, 100*row.GBps/l, l, MaxPctOfLink))
		}
	}
	return bad
}

// Link reference: linkWarm of contiguous copies both ways (at most
// linkWarmRuns runs) before the timed runs, which are at least linkReps.
// A link that idles may run below its speed at first (power states, a
// PCIe link trained down), and one warm-up copy is not enough: it left the
// reference well below what another program measured the same minute.
const (
	linkWarm     = 500 * time.Millisecond
	linkWarmRuns = 64
	linkReps     = 8
)

// linkPiece is the piece size of the second contiguous reference: the
// same bytes as the one-copy reference, in order, as pieces of this size
// through the batch API (the "batch" variant). One copy a direction does
// not use the copy engines as the batch API does: on an H100 it read
// below batched 2 MiB segments both ways, and the run was invalid
// (bench/results/h100-80gb-hbm3/bench.txt, the figures there).
const linkPiece = 2 << 20

// measureLink times the contiguous reference: TotalBytes in one copy
// devA → hostA on b.s[0] (d2h), hostB → devB on b.s[1] (h2d), and both at
// once (separate streams and buffers), after a warm-up of both ways; and,
// where the bench has a batch variant, the same contiguous bytes in
// linkPiece pieces through it (pieced). Each direction's reference is the
// faster of the two: a reference must be the best contiguous copy the
// machine makes, or scattered rows read above it.
func (b *bench) measureLink() (map[string]timing, error) {
	n := b.cfg.TotalBytes
	d2h := func(tickets *[]tk) error {
		return b.drv.MemcpyAsync(cuda.DevicePtr(b.hostA.addr()), b.devA, n, b.s[0])
	}
	h2d := func(tickets *[]tk) error {
		return b.drv.MemcpyAsync(b.devB, cuda.DevicePtr(b.hostB.addr()), n, b.s[1])
	}
	both := func(t *[]tk) error { return errors.Join(d2h(t), h2d(t)) }
	start := time.Now()
	for i := 0; i < linkWarmRuns && time.Since(start) < linkWarm; i++ {
		if _, err := b.measure(both, 0); err != nil {
			return nil, fmt.Errorf("bench: contiguous warm-up: %w", err)
		}
	}
	bv, segs := b.linkPieces()
	out := map[string]timing{}
	for _, c := range []struct {
		dir string
		f   func(*[]tk) error
	}{{"d2h", d2h}, {"h2d", h2d}, {"both", both}} {
		tm, err := b.repsN(c.f, true, max(b.cfg.Reps, linkReps))
		if err != nil {
			return nil, fmt.Errorf("bench: contiguous %s: %w", c.dir, err)
		}
		if bv != nil {
			pt, err := b.repsN(b.enqueueFor(bv, c.dir, segs), true, max(b.cfg.Reps, linkReps))
			if err != nil {
				return nil, fmt.Errorf("bench: contiguous %s in %s pieces: %w", c.dir, cudacopy.FormatBytes(linkPiece), err)
			}
			if pt.best < tm.best {
				tm = pt
			}
		}
		out[c.dir] = tm
	}
	return out, nil
}

// linkPieces is the batch variant and the contiguous segments (in order,
// linkPiece each, host offset = device offset) of the pieced reference;
// nil when the bench has no batch variant or TotalBytes is not a multiple
// of linkPiece.
func (b *bench) linkPieces() (*variant, segSet) {
	n := b.cfg.TotalBytes
	if n < linkPiece || n%linkPiece != 0 {
		return nil, segSet{}
	}
	var bv *variant
	for _, v := range b.variants {
		if v.name == "batch" && v.method == cudacopy.MethodBatch && v.fan == nil {
			bv = v
			break
		}
	}
	if bv == nil {
		return nil, segSet{}
	}
	k := int(n / linkPiece)
	segs := segSet{d2h: make([]cudacopy.Segment, k), h2d: make([]cudacopy.Segment, k)}
	for i := range k {
		off := uint64(i) * linkPiece
		segs.d2h[i] = cudacopy.Segment{Dst: b.hostA.addr() + off, Src: uint64(b.devA) + off, Len: linkPiece}
		segs.h2d[i] = cudacopy.Segment{Dst: uint64(b.devB) + off, Src: b.hostB.addr() + off, Len: linkPiece}
	}
	return bv, segs
}

// linkBytes is the bytes one contiguous run of dir moves.
func (b *bench) linkBytes(dir string) uint64 {
	if dir == "both" {
		return 2 * b.cfg.TotalBytes
	}
	return b.cfg.TotalBytes
}

// link measures the contiguous reference into res.Link and
// res.LinkBefore and appends its rows.
func (b *bench) link(res *ThroughputResults) error {
	tms, err := b.measureLink()
	if err != nil {
		return err
	}
	res.LinkBefore = map[string]float64{}
	for _, dir := range []string{"d2h", "h2d", "both"} {
		tm := tms[dir]
		g := gbps(b.linkBytes(dir), tm.best)
		res.Link[dir], res.LinkBefore[dir] = g, g
		res.Rows = append(res.Rows, ThroughputRow{Method: "contiguous", Dir: dir, SegBytes: b.cfg.TotalBytes, GBps: g, MedianGBps: gbps(b.linkBytes(dir), tm.median), PctOfLink: 100, Background: "none", Gated: tm.held})
	}
	return nil
}

// relink measures the reference again after the rows (res.LinkAfter),
// keeps the faster of the two per direction as res.Link (and in the
// contiguous rows), recomputes every row's PctOfLink against it, and
// records the rows above MaxPctOfLink in res.Invalid.
func (b *bench) relink(res *ThroughputResults) error {
	tms, err := b.measureLink()
	if err != nil {
		return err
	}
	res.LinkAfter = map[string]float64{}
	for i := range res.Rows {
		row := &res.Rows[i]
		if row.Method != "contiguous" {
			continue
		}
		tm := tms[row.Dir]
		g := gbps(b.linkBytes(row.Dir), tm.best)
		res.LinkAfter[row.Dir] = g
		if g > row.GBps {
			row.GBps, row.MedianGBps, row.Gated = g, gbps(b.linkBytes(row.Dir), tm.median), tm.held
			res.Link[row.Dir] = g
		}
	}
	for i := range res.Rows {
		if l := res.Link[res.Rows[i].Dir]; l > 0 {
			res.Rows[i].PctOfLink = 100 * res.Rows[i].GBps / l
		}
	}
	res.Invalid = LinkVerdict(res.Link, res.Rows)
	return nil
}

// formatInvalid renders LinkVerdict's lines as the INVALID notice, or
// nothing for a valid run.
func formatInvalid(bad []string) string {
	if len(bad) == 0 {
		return ""
	}
	var b strings.Builder
	fmt.Fprintf(&b, "**INVALID**: %d row(s) above %d%% of the link; the link reference or those rows are wrong, and no target is reported:\n\n", len(bad), MaxPctOfLink)
	for _, l := range bad {
		fmt.Fprintf(&b, "- %s\n", l)
	}
	b.WriteString("\n")
	return b.String()
}
