package benchgpu

import (
	"bytes"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/svgtest"

	kvbench "github.com/kvoffload/kvoffload/bench"
)

func svgSampleResults() ThroughputResults {
	r := ThroughputResults{Device: "NVIDIA H200 <test & co>", Link: map[string]float64{"d2h": 55.3, "h2d": 55.4, "both": 95.3}}
	for _, seg := range []uint64{4 << 10, 16 << 10, 64 << 10, 256 << 10, 2 << 20} {
		f := math.Log2(float64(seg))
		r.Rows = append(r.Rows,
			ThroughputRow{Method: "memcpy", Dir: "d2h", SegBytes: seg, GBps: f * 2, Background: "none"},
			ThroughputRow{Method: "kernel", CTAs: 8, Dir: "d2h", SegBytes: seg, GBps: 52, Background: "none"},
			ThroughputRow{Method: "kernel", CTAs: 8, Dir: "d2h", SegBytes: seg, GBps: 40, Background: "sgemm"},
			ThroughputRow{Method: "batch", Dir: "h2d", SegBytes: seg, GBps: f * 3, Background: "none"},
		)
	}
	r.Rows = append(r.Rows, ThroughputRow{Method: "contiguous", Dir: "d2h", SegBytes: 2 << 30, GBps: 55.3, Background: "none"})
	return r
}

func TestThroughputChartSVG(t *testing.T) {
	c := ThroughputChart(svgSampleResults(), "d2h")
	require.Len(t, c.Series, 2, "memcpy and kernel/8; no sgemm rows, no other direction, no contiguous row")
	require.Equal(t, "memcpy", c.Series[0].Name)
	require.Equal(t, "kernel/8 CTAs", c.Series[1].Name)
	require.Len(t, c.Series[1].X, 5)
	require.Equal(t, []kvbench.RefLine{{Name: "link 55.3 GB/s", Y: 55.3}}, c.Refs)

	var b bytes.Buffer
	require.NoError(t, kvbench.WriteSVG(&b, c))
	els := svgtest.Parse(t, b.Bytes())
	require.Len(t, els["polyline"], 2)
	require.Len(t, els["circle"], 10)
	dashed := 0
	for _, l := range els["line"] {
		if svgtest.Attr(l, "class") == "ref" {
			require.NotEmpty(t, svgtest.Attr(l, "stroke-dasharray"), "the link line is dashed")
			dashed++
		}
	}
	require.Equal(t, 1, dashed)
	s := b.String()
	require.Contains(t, s, "&lt;test &amp; co&gt;", "text is escaped")
	for _, tick := range []string{">4K<", ">16K<", ">2M<", ">link 55.3 GB/s<"} {
		require.Contains(t, s, tick)
	}
}
