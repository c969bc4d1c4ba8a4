package benchgpu

import (
	"fmt"
	"strconv"

	kvbench "github.com/kvoffload/kvoffload/bench"
)

// ThroughputChart is the plot of a throughput sweep for one direction
// ("d2h", "h2d" or "both"): GB/s against segment size, one line per method
// (and kernel grid size), without background load, and the contiguous link
// reference as a dashed line.
func ThroughputChart(r ThroughputResults, dir string) kvbench.Chart {
	c := kvbench.Chart{
		Title:  fmt.Sprintf("Scattered KV segments, %s — %s", dir, r.Device),
		XLabel: "segment size", YLabel: "GB/s", LogX: true,
		XTick: func(x float64) string { return sizeLabel(uint64(x)) },
	}
	byName := map[string]int{}
	for _, row := range r.Rows {
		if row.Dir != dir || row.Background != "none" || row.Method == "contiguous" {
			continue
		}
		name := row.Method
		if row.Method == "kernel" && row.CTAs > 0 {
			name = fmt.Sprintf("kernel/%d CTAs", row.CTAs)
		}
		i, ok := byName[name]
		if !ok {
			i = len(c.Series)
			byName[name] = i
			c.Series = append(c.Series, kvbench.Series{Name: name})
		}
		c.Series[i].X = append(c.Series[i].X, float64(row.SegBytes))
		c.Series[i].Y = append(c.Series[i].Y, row.GBps)
	}
	if l, ok := r.Link[dir]; ok && l > 0 {
		c.Refs = append(c.Refs, kvbench.RefLine{Name: fmt.Sprintf("link %.1f GB/s", l), Y: l})
	}
	return c
}

// sizeLabel renders a power-of-two-ish byte size compactly: 4K, 64K, 2M.
func sizeLabel(n uint64) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return strconv.FormatUint(n>>30, 10) + "G"
	case n >= 1<<20 && n%(1<<20) == 0:
		return strconv.FormatUint(n>>20, 10) + "M"
	case n >= 1<<10 && n%(1<<10) == 0:
		return strconv.FormatUint(n>>10, 10) + "K"
	}
	return strconv.FormatUint(n, 10)
}
