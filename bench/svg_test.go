package bench

import (
	"bytes"
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"

	"github.com/kvoffload/kvoffload/internal/svgtest"
)

func TestWriteSVGRejects(t *testing.T) {
	for name, c := range map[string]Chart{
		"no points":    {},
		"lengths":      {Series: []Series{{Name: "a", X: []float64{1, 2}, Y: []float64{1}}}},
		"NaN":          {Series: []Series{{Name: "a", X: []float64{1}, Y: []float64{math.NaN()}}}},
		"zero on log":  {LogX: true, Series: []Series{{Name: "a", X: []float64{0}, Y: []float64{1}}}},
		"infinite ref": {Series: []Series{{Name: "a", X: []float64{1}, Y: []float64{1}}}, Refs: []RefLine{{Y: math.Inf(1)}}},
	} {
		var b bytes.Buffer
		err := WriteSVG(&b, c)
		require.ErrorIs(t, err, ErrChart, name)
		require.Zero(t, b.Len(), "%s: nothing written", name)
	}
}

// TestWriteSVGWellFormed: any valid chart, with any names, is well-formed
// XML with one polyline per series and one dashed line per reference.
func TestWriteSVGWellFormed(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		logX := rapid.Bool().Draw(t, "logX")
		c := Chart{Title: rapid.String().Draw(t, "title"), XLabel: "x", YLabel: "y", LogX: logX}
		for range rapid.IntRange(1, 6).Draw(t, "series") {
			n := rapid.IntRange(1, 8).Draw(t, "points")
			s := Series{Name: rapid.StringMatching(`[a-z<>&"' ]{0,12}`).Draw(t, "name")}
			for range n {
				s.X = append(s.X, rapid.Float64Range(1, 1e7).Draw(t, "x"))
				s.Y = append(s.Y, rapid.Float64Range(0, 1e3).Draw(t, "y"))
			}
			c.Series = append(c.Series, s)
		}
		refs := rapid.IntRange(0, 2).Draw(t, "refs")
		for range refs {
			c.Refs = append(c.Refs, RefLine{Name: "ref", Y: rapid.Float64Range(0, 1e3).Draw(t, "refY")})
		}
		var b bytes.Buffer
		if err := WriteSVG(&b, c); err != nil {
			t.Fatalf("WriteSVG: %v", err)
		}
		els := svgtest.Parse(t, b.Bytes())
		if len(els["polyline"]) != len(c.Series) {
			t.Fatalf("%d polylines for %d series", len(els["polyline"]), len(c.Series))
		}
		if got := strings.Count(b.String(), `class="ref"`); got != refs {
			t.Fatalf("%d reference lines for %d refs", got, refs)
		}
	})
}

func TestNiceStep(t *testing.T) {
	for _, tt := range []struct{ span, want float64 }{{60, 20}, {100, 20}, {7, 2}, {0.3, 0.1}, {0, 1}} {
		require.InDelta(t, tt.want, niceStep(tt.span, 5), 1e-12, "span %v", tt.span)
	}
}
