package bench

import (
	"bufio"
	"cmp"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
)

// Chart is a line chart written as SVG by WriteSVG, without a plotting
// dependency: one polyline per Series, and horizontal reference lines
// (such as the link's speed) drawn dashed.
type Chart struct {
	Title  string
	XLabel string
	YLabel string
	// LogX puts the x axis on a log2 scale (segment sizes); every X must
	// then be positive.
	LogX bool
	// XTick formats an x tick's value (default: %g).
	XTick func(x float64) string
	// Series are the lines, drawn in order.
	Series []Series
	// Refs are horizontal dashed lines across the whole plot.
	Refs []RefLine
}

// Series is one line of a Chart: points (X[i], Y[i]), drawn in order of X.
type Series struct {
	Name string
	X, Y []float64
}

// RefLine is a dashed horizontal line at Y.
type RefLine struct {
	Name string
	Y    float64
}

// ErrChart: a Chart cannot be drawn (no points, mismatched lengths, a value
// that is not finite, or a non-positive x on a log axis).
var ErrChart = errors.New("bench: invalid chart")

// SVG canvas geometry, in user units.
const (
	svgW, svgH                     = 760, 440
	padL, padR, padT, padB         = 70, 190, 40, 56
	plotW, plotH                   = svgW - padL - padR, svgH - padT - padB
	legendX, legendY, legendLineDY = svgW - padR + 16, padT + 8, 20
)

// palette is a colour-blind-friendly set (Okabe–Ito), cycled.
var palette = []string{"#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442", "#000000"}

// validate checks c and returns its data bounds.
func (c Chart) validate() (x0, x1, y1 float64, err error) {
	x0, x1 = math.Inf(1), math.Inf(-1)
	points := 0
	for _, s := range c.Series {
		if len(s.X) != len(s.Y) {
			return 0, 0, 0, fmt.Errorf("%w: series %q has %d x values and %d y values", ErrChart, s.Name, len(s.X), len(s.Y))
		}
		for i, x := range s.X {
			y := s.Y[i]
			if math.IsNaN(x) || math.IsInf(x, 0) || math.IsNaN(y) || math.IsInf(y, 0) {
				return 0, 0, 0, fmt.Errorf("%w: series %q point %d (%v, %v) is not finite", ErrChart, s.Name, i, x, y)
			}
			if c.LogX && x <= 0 {
				return 0, 0, 0, fmt.Errorf("%w: series %q point %d has x = %v on a log axis", ErrChart, s.Name, i, x)
			}
			x0, x1, y1 = min(x0, x), max(x1, x), max(y1, y)
			points++
		}
	}
	if points == 0 {
		return 0, 0, 0, fmt.Errorf("%w: no points", ErrChart)
	}
	for _, r := range c.Refs {
		if math.IsNaN(r.Y) || math.IsInf(r.Y, 0) {
			return 0, 0, 0, fmt.Errorf("%w: reference line %q at %v", ErrChart, r.Name, r.Y)
		}
		y1 = max(y1, r.Y)
	}
	return x0, x1, y1, nil
}

// niceStep returns a round tick step (1, 2 or 5 × 10^k) giving about n
// ticks over [0, span].
func niceStep(span float64, n int) float64 {
	if span <= 0 {
		return 1
	}
	raw := span / float64(n)
	mag := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*mag >= raw {
			return m * mag
		}
	}
	return 10 * mag
}

// WriteSVG writes c as a standalone SVG document. Nothing is written when
// c is invalid (ErrChart).
func WriteSVG(w io.Writer, c Chart) error {
	x0, x1, y1, err := c.validate()
	if err != nil {
		return err
	}
	tick := c.XTick
	if tick == nil {
		tick = func(x float64) string { return strconv.FormatFloat(x, 'g', -1, 64) }
	}
	fx := func(x float64) float64 { return x }
	if c.LogX {
		fx = math.Log2
	}
	lo, hi := fx(x0), fx(x1)
	if hi == lo {
		lo, hi = lo-1, hi+1
	}
	ystep := niceStep(max(y1, 1e-9), 5)
	ytop := math.Ceil(max(y1, 1e-9)*1.05/ystep) * ystep
	px := func(x float64) float64 { return padL + (fx(x)-lo)/(hi-lo)*plotW }
	py := func(y float64) float64 { return padT + plotH - y/ytop*plotH }

	bw := bufio.NewWriter(w)
	p := func(format string, args ...any) { fmt.Fprintf(bw, format, args...) }
	p(`<?xml version="1.0" encoding="UTF-8"?>` + "\n")
	p(`<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n", svgW, svgH, svgW, svgH)
	p(`<rect width="100%%" height="100%%" fill="white"/>` + "\n")
	p(`<text x="%d" y="%d" font-size="15" font-weight="bold">%s</text>`+"\n", padL, padT-16, esc(c.Title))

	// Grid and y ticks.
	for y := 0.0; y <= ytop+ystep/2; y += ystep {
		p(`<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#e0e0e0"/>`+"\n", padL, py(y), padL+plotW, py(y))
		p(`<text x="%d" y="%.1f" text-anchor="end">%s</text>`+"\n", padL-6, py(y)+4, esc(strconv.FormatFloat(y, 'g', 4, 64)))
	}
	// X ticks at the distinct x values.
	var xs []float64
	for _, s := range c.Series {
		xs = append(xs, s.X...)
	}
	slices.Sort(xs)
	for _, x := range slices.Compact(xs) {
		p(`<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#e0e0e0"/>`+"\n", px(x), padT, px(x), padT+plotH)
		p(`<text x="%.1f" y="%d" text-anchor="middle">%s</text>`+"\n", px(x), padT+plotH+16, esc(tick(x)))
	}
	p(`<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#444"/>`+"\n", padL, padT, plotW, plotH)
	p(`<text x="%d" y="%d" text-anchor="middle">%s</text>`+"\n", padL+plotW/2, svgH-12, esc(c.XLabel))
	p(`<text transform="translate(18 %d) rotate(-90)" text-anchor="middle">%s</text>`+"\n", padT+plotH/2, esc(c.YLabel))

	legend := 0
	legendEntry := func(name, color, dash string) {
		y := legendY + legend*legendLineDY
		p(`<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2"%s/>`+"\n", legendX, y, legendX+24, y, color, dash)
		p(`<text x="%d" y="%d">%s</text>`+"\n", legendX+30, y+4, esc(name))
		legend++
	}
	for _, r := range c.Refs {
		p(`<line class="ref" x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#555" stroke-width="1.5" stroke-dasharray="6 4"/>`+"\n", padL, py(r.Y), padL+plotW, py(r.Y))
		legendEntry(r.Name, "#555", ` stroke-dasharray="6 4"`)
	}
	for i, s := range c.Series {
		color := palette[i%len(palette)]
		idx := make([]int, len(s.X))
		for j := range idx {
			idx[j] = j
		}
		slices.SortFunc(idx, func(a, b int) int { return cmp.Compare(s.X[a], s.X[b]) })
		pts := make([]string, len(idx))
		for j, k := range idx {
			pts[j] = fmt.Sprintf("%.1f,%.1f", px(s.X[k]), py(s.Y[k]))
		}
		p(`<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>`+"\n", color, strings.Join(pts, " "))
		for _, k := range idx {
			p(`<circle cx="%.1f" cy="%.1f" r="3" fill="%s"><title>%s</title></circle>`+"\n", px(s.X[k]), py(s.Y[k]), color,
				esc(fmt.Sprintf("%s: %s → %.3g", s.Name, tick(s.X[k]), s.Y[k])))
		}
		legendEntry(s.Name, color, "")
	}
	p("</svg>\n")
	return bw.Flush()
}

// esc escapes s for XML text and attributes; characters XML cannot hold
// (control characters, invalid UTF-8) become U+FFFD.
func esc(s string) string {
	var b strings.Builder
	_ = xml.EscapeText(&b, []byte(s)) // a strings.Builder never fails
	return b.String()
}
