package benchgpu

// The throughput results as CSV (WriteThroughputCSV) and markdown
// (FormatThroughput, with formatTargets checking issue 5's targets).
// Functions of the results alone: no locks.

import (
	"encoding/csv"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"

	"github.com/kvoffload/kvoffload/internal/cudacopy"
)

// WriteThroughputCSV writes one line per row: method, ctas, dir, seg_bytes,
// gbps (gated GPU rate), pct_of_link, then median_gbps, background,
// pct_of_solo, sgemm_slowdown_pct, chosen, gated, pipelined_gbps,
// submit_ns_per_seg.
func WriteThroughputCSV(w io.Writer, r ThroughputResults) error {
	cw := csv.NewWriter(w)
	_ = cw.Write([]string{"method", "ctas", "dir", "seg_bytes", "gbps", "pct_of_link", "median_gbps", "background", "pct_of_solo", "sgemm_slowdown_pct", "chosen", "gated", "pipelined_gbps", "submit_ns_per_seg"})
	f := func(v float64) string { return strconv.FormatFloat(v, 'f', 2, 64) }
	for _, row := range r.Rows {
		_ = cw.Write([]string{row.Method, strconv.Itoa(row.CTAs), row.Dir, strconv.FormatUint(row.SegBytes, 10), f(row.GBps), f(row.PctOfLink), f(row.MedianGBps), row.Background, f(row.PctOfSolo), f(row.SGEMMSlowdownPct), row.Chosen, strconv.FormatBool(row.Gated), f(row.PipelinedGBps), f(row.SubmitNsPerSeg)})
	}
	cw.Flush()
	return cw.Error()
}

// FormatThroughput renders the results as markdown: the link reference,
// one table per direction (segment sizes × variants, GB/s and % of the
// link), the burn table, and the targets checked against the run.
func FormatThroughput(r ThroughputResults) string {
	var b strings.Builder
	fmt.Fprintf(&b, "# Transfer throughput: %s (driver %d)\n\n", r.Device, r.DriverVersion)
	if r.Config.Command != "" {
		fmt.Fprintf(&b, "Command: `%s`\n\n", r.Config.Command)
	}
	fmt.Fprintf(&b, "%s per direction per run, best of %d (median in the CSV), CUDA events; kernel %d threads/CTA; batch API: %v.\n\n",
		cudacopy.FormatBytes(r.Config.TotalBytes), r.Config.Reps, r.Config.Threads, r.Capabilities.Batch)
	fmt.Fprintf(&b, "Link (contiguous, pinned; the faster of one copy a direction and the same bytes in %s pieces by the batch API): d2h %.1f GB/s, h2d %.1f GB/s, both %.1f GB/s.", cudacopy.FormatBytes(linkPiece), r.Link["d2h"], r.Link["h2d"], r.Link["both"])
	if r.LinkBefore != nil && r.LinkAfter != nil {
		fmt.Fprintf(&b, " The best of before the rows (d2h %.1f, h2d %.1f, both %.1f) and after them (d2h %.1f, h2d %.1f, both %.1f), each after a warm-up of %v, best of %d.",
			r.LinkBefore["d2h"], r.LinkBefore["h2d"], r.LinkBefore["both"], r.LinkAfter["d2h"], r.LinkAfter["h2d"], r.LinkAfter["both"], linkWarm, max(r.Config.Reps, linkReps))
	}
	b.WriteString("\n\n")
	b.WriteString(formatInvalid(r.Invalid))
	b.WriteString("GPU rate (the first table per direction): each run enqueued while the streams wait behind a spin kernel sized at twice the measured submit time, then timed with events, so the time is the copies', not the CPU's building them; † marks points where the gate did not hold or none ran (submission over " + maxGate.String() + "/2: the rate includes the CPU time, which is that method's limit). Pipelined: the same bytes as " + strconv.Itoa(pipeParts) + " back-to-back Submits per direction, ungated, as a serving engine overlaps them (where no gate ran, the ungated run itself: the same driver calls). Points whose warm-up took over " + strconv.Itoa(slowRunMs) + " ms get " + strconv.Itoa(slowReps) + " timed runs. CPU: median wall time of Submit per segment.\n\n")

	var variants []string
	cell := map[string]ThroughputRow{}
	for _, row := range r.Rows {
		if row.Background != "none" || row.Method == "contiguous" {
			continue
		}
		if !slices.Contains(variants, row.variant()) {
			variants = append(variants, row.variant())
		}
		cell[row.variant()+"/"+row.Dir+"/"+strconv.FormatUint(row.SegBytes, 10)] = row
	}
	header := func(title string) {
		fmt.Fprintf(&b, "%s\n\n| segment |", title)
		for _, v := range variants {
			fmt.Fprintf(&b, " %s |", v)
		}
		b.WriteString("\n|---|")
		for range variants {
			b.WriteString("---|")
		}
		b.WriteString("\n")
	}
	table := func(dir string, format func(row ThroughputRow) string) {
		for _, size := range r.Config.SegSizes {
			fmt.Fprintf(&b, "| %s |", cudacopy.FormatBytes(size))
			for _, v := range variants {
				row, ok := cell[v+"/"+dir+"/"+strconv.FormatUint(size, 10)]
				if !ok {
					b.WriteString(" – |")
					continue
				}
				fmt.Fprintf(&b, " %s |", format(row))
			}
			b.WriteString("\n")
		}
		b.WriteString("\n")
	}
	for _, dir := range []string{"d2h", "h2d", "both"} {
		header(fmt.Sprintf("## %s: GPU rate, gated (GB/s, %% of link)", dir))
		table(dir, func(row ThroughputRow) string {
			s := fmt.Sprintf("%.1f (%.0f%%)", row.GBps, row.PctOfLink)
			if !row.Gated {
				s += "†"
			}
			if row.Chosen != "" {
				s += " " + row.Chosen
			}
			return s
		})
		header(fmt.Sprintf("### %s: pipelined GB/s · CPU submit ns per segment", dir))
		table(dir, func(row ThroughputRow) string {
			return fmt.Sprintf("%.1f · %.0f ns", row.PipelinedGBps, row.SubmitNsPerSeg)
		})
	}

	b.WriteString("## Beside a matrix product\n\n")
	if r.SGEMM.Skipped != "" {
		fmt.Fprintf(&b, "Skipped: %s\n\n", r.SGEMM.Skipped)
	} else {
		fmt.Fprintf(&b, "kvo_sgemm n=%d alone: %.2f ms (%.1f TFLOPS).\n\n| variant | dir | segment | GB/s | %% of solo | sgemm slowdown |\n|---|---|---|---|---|---|\n", r.SGEMM.N, r.SGEMM.SoloMs, r.SGEMM.TFLOPS)
		for _, row := range r.Rows {
			if row.Background == "sgemm" {
				fmt.Fprintf(&b, "| %s | %s | %s | %.1f | %.0f%% | %+.1f%% |\n", row.variant(), row.Dir, cudacopy.FormatBytes(row.SegBytes), row.GBps, row.PctOfSolo, row.SGEMMSlowdownPct)
			}
		}
		b.WriteString("\n")
	}
	if len(r.Invalid) > 0 {
		b.WriteString("## Targets\n\nNot reported: the run is INVALID (see above).\n")
	} else {
		b.WriteString(formatTargets(r, cell, variants))
	}
	if r.Calibration != nil {
		fmt.Fprintf(&b, "\n## Calibration used by auto (kernel D2H %v, H2D %v; %s per point)\n\n%s", r.Calibration.D2H, r.Calibration.H2D, cudacopy.FormatBytes(r.Calibration.TotalBytes), r.Calibration.Markdown())
	}
	return b.String()
}

// formatTargets checks issue 5's targets against the run.
func formatTargets(r ThroughputResults, cell map[string]ThroughputRow, variants []string) string {
	var b strings.Builder
	b.WriteString("## Targets\n\n")
	mark := func(ok bool) string {
		if ok {
			return "met"
		}
		return "MISSED"
	}
	for _, dir := range []string{"d2h", "h2d", "both"} {
		need := map[string]float64{"d2h": 92, "h2d": 90, "both": 90}[dir]
		for _, size := range r.Config.SegSizes {
			k := "/" + dir + "/" + strconv.FormatUint(size, 10)
			auto, ok := cell["auto"+k]
			if !ok {
				continue
			}
			var best ThroughputRow
			for _, v := range variants {
				if row := cell[v+k]; row.GBps > best.GBps {
					best = row
				}
			}
			pctBest := 100 * auto.GBps / best.GBps
			fmt.Fprintf(&b, "- %s %s: auto %.1f GB/s = %.1f%% of best (%s) [≥97%%: %s], %.1f%% of link [≥%.0f%%: %s]\n",
				dir, cudacopy.FormatBytes(size), auto.GBps, pctBest, best.variant(), mark(pctBest >= 97), auto.PctOfLink, need, mark(auto.PctOfLink >= need))
		}
	}
	for _, row := range r.Rows {
		if row.Background == "sgemm" && row.Method == "auto" {
			fmt.Fprintf(&b, "- beside sgemm, auto %s %s: %.0f%% of solo [≥80%%: %s], sgemm slowed %.1f%% [≤10%%: %s]\n",
				row.Dir, cudacopy.FormatBytes(row.SegBytes), row.PctOfSolo, mark(row.PctOfSolo >= 80), row.SGEMMSlowdownPct, mark(row.SGEMMSlowdownPct <= 10))
		}
	}
	return b.String()
}
