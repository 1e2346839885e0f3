// Package chart draws small time-series charts as inline SVG for the admin page: no JavaScript,
// no external assets. A chart carries its own title and description for screen readers, and its
// numbers as rows for a table beside it. It is internal to the worker binary.
package chart

import (
	"fmt"
	"html/template"
	"math"
	"regexp"
	"strconv"
	"strings"
)

// Kind is how a chart draws its series.
type Kind int

const (
	// Bars stacks the series as one bar per bucket.
	Bars Kind = iota
	// Lines draws each series as a line; a value alone between gaps is drawn as a dot.
	Lines
)

// Series is one named sequence of values, one per bucket of the chart.
type Series struct {
	// Name labels the series in the legend and the table.
	Name string
	// Class names the series' colour: the SVG elements get class "s-<Class>". Only letters,
	// digits and '-' are kept.
	Class string
	// Values holds one value per bucket. NaN means no data (a gap); negative values and
	// infinities are drawn as no data too.
	Values []float64
}

// Chart is one chart: buckets along the x axis, one or more series.
type Chart struct {
	// ID is the chart's element id and the prefix of its inner ids; only letters, digits and
	// '-' are kept.
	ID string
	// Title names the chart (the SVG's <title>); Desc says what it shows (its <desc>).
	Title, Desc string
	// Labels name the buckets, one per bucket (the table's first column; the x axis shows the
	// first, middle and last).
	Labels []string
	Series []Series
	Kind   Kind
	// Format writes a value for axis labels and the table. Default: Number.
	Format func(float64) string
	// Integer marks values that are counts: the y axis then ends at an even whole number, so
	// that its middle line is whole too.
	Integer bool
	// Width and Height of the drawing in SVG units. Defaults 360 and 150 (about the size it is
	// shown at, so that its text is the size of the page's).
	Width, Height int
}

// Layout margins, in SVG units: room for the y-axis labels on the left and the x-axis labels
// below.
const (
	marginLeft   = 52
	marginRight  = 8
	marginTop    = 8
	marginBottom = 20
)

var unsafeIDChars = regexp.MustCompile(`[^A-Za-z0-9-]`)

func cleanID(s string) string { return unsafeIDChars.ReplaceAllString(s, "") }

// valid reports whether v can be drawn.
func valid(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) && v >= 0 }

// num writes a coordinate, to a tenth, within ±1e6 (far outside any drawing). Non-finite values
// (which valid keeps out) would make the SVG invalid, so they are written as 0 should one ever
// get here.
func num(f float64) string {
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return "0"
	}
	f = min(max(f, -1e6), 1e6)
	return strconv.FormatFloat(math.Round(f*10)/10, 'f', -1, 64)
}

// Number writes v with at most one decimal (in exponent notation from 1e12 on); the default
// Format.
func Number(v float64) string {
	if math.Abs(v) >= 1e12 {
		return strconv.FormatFloat(v, 'g', 4, 64)
	}
	return strconv.FormatFloat(math.Round(v*10)/10, 'f', -1, 64)
}

func (c Chart) format(v float64) string {
	if c.Format != nil {
		return c.Format(v)
	}
	return Number(v)
}

// buckets is the number of buckets: the longest of Labels and the series.
func (c Chart) buckets() int {
	n := len(c.Labels)
	for _, s := range c.Series {
		n = max(n, len(s.Values))
	}
	return n
}

func (s Series) at(i int) (float64, bool) {
	if i >= len(s.Values) || !valid(s.Values[i]) {
		return 0, false
	}
	return s.Values[i], true
}

// top is the largest value drawn (the largest stack for Bars).
func (c Chart) top() float64 {
	top := 0.0
	for i := range c.buckets() {
		sum := 0.0
		for _, s := range c.Series {
			if v, ok := s.at(i); ok {
				if c.Kind == Bars {
					sum += v
				} else {
					top = max(top, v)
				}
			}
		}
		top = max(top, sum)
	}
	return min(top, math.MaxFloat64) // a sum of huge values may overflow
}

// niceCeil rounds v up to 1, 2 or 5 times a power of ten; 1 for a v that is not positive and
// finite.
func niceCeil(v float64) float64 {
	if !(v > 0) || math.IsInf(v, 0) {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if v <= m*p*(1+1e-9) && !math.IsInf(m*p, 0) {
			return m * p
		}
	}
	return v
}

// evenCeil rounds v up to 1, 2 or 4 times a power of ten, at least 2: the top of an axis of
// counts whose middle is a whole number too.
func evenCeil(v float64) float64 {
	if !(v > 2) || math.IsInf(v, 0) {
		return 2
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 4, 10} {
		if v <= m*p*(1+1e-9) && !math.IsInf(m*p, 0) {
			return m * p
		}
	}
	return v
}

// Empty reports that the chart has no value to draw.
func (c Chart) Empty() bool {
	for i := range c.buckets() {
		for _, s := range c.Series {
			if _, ok := s.at(i); ok {
				return false
			}
		}
	}
	return true
}

// SVG draws the chart. Every text is escaped and every number finite, whatever the values.
func (c Chart) SVG() template.HTML {
	w, h := c.Width, c.Height
	if w <= 0 {
		w = 360
	}
	if h <= 0 {
		h = 150
	}
	id := cleanID(c.ID)
	n := c.buckets()
	plotW := float64(w - marginLeft - marginRight)
	plotH := float64(h - marginTop - marginBottom)
	ymax := niceCeil(c.top())
	if c.Integer {
		ymax = evenCeil(c.top())
	}
	y := func(v float64) float64 { return marginTop + plotH - v/ymax*plotH }
	bw := plotW / float64(max(n, 1))
	x := func(i int) float64 { return marginLeft + bw*float64(i) + bw/2 }

	var b strings.Builder
	esc := template.HTMLEscapeString
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 %d %d" width="%d" height="%d" role="img" aria-labelledby="%s-title %s-desc" id="%s-svg">`,
		w, h, w, h, id, id, id)
	fmt.Fprintf(&b, `<title id="%s-title">%s</title><desc id="%s-desc">%s</desc>`, id, esc(c.Title), id, esc(c.Desc))
	// Grid lines and y-axis labels at 0, half and the top.
	for _, f := range []float64{0, 0.5, 1} {
		v := ymax * f
		fmt.Fprintf(&b, `<line class="grid" x1="%d" x2="%d" y1="%s" y2="%s"/>`, marginLeft, w-marginRight, num(y(v)), num(y(v)))
		fmt.Fprintf(&b, `<text class="axis" x="%d" y="%s" text-anchor="end" dominant-baseline="middle">%s</text>`,
			marginLeft-4, num(y(v)), esc(c.format(v)))
	}
	// X-axis labels: first, middle, last.
	if len(c.Labels) > 0 {
		for _, i := range uniq(0, len(c.Labels)/2, len(c.Labels)-1) {
			anchor := "middle"
			switch i {
			case 0:
				anchor = "start"
			case len(c.Labels) - 1:
				anchor = "end"
			}
			xi := x(i)
			if anchor == "start" {
				xi -= bw / 2
			} else if anchor == "end" {
				xi += bw / 2
			}
			fmt.Fprintf(&b, `<text class="axis" x="%s" y="%d" text-anchor="%s">%s</text>`, num(xi), h-4, anchor, esc(c.Labels[i]))
		}
	}
	switch c.Kind {
	case Bars:
		for i := range n {
			base := 0.0
			for _, s := range c.Series {
				v, ok := s.at(i)
				if !ok || v == 0 {
					continue
				}
				top := y(base + v)
				fmt.Fprintf(&b, `<rect class="bar s-%s" x="%s" y="%s" width="%s" height="%s"><title>%s %s: %s</title></rect>`,
					cleanID(s.Class), num(x(i)-bw*0.4), num(top), num(bw*0.8), num(y(base)-top),
					esc(label(c.Labels, i)), esc(s.Name), esc(c.format(v)))
				base += v
			}
		}
	case Lines:
		for _, s := range c.Series {
			var run []string
			flush := func(last int) {
				switch len(run) {
				case 0:
				case 1:
					v, _ := s.at(last)
					fmt.Fprintf(&b, `<circle class="dot s-%s" cx="%s" cy="%s" r="2.5"/>`, cleanID(s.Class), num(x(last)), num(y(v)))
				default:
					fmt.Fprintf(&b, `<polyline class="line s-%s" points="%s"/>`, cleanID(s.Class), strings.Join(run, " "))
				}
				run = run[:0]
			}
			for i := range n {
				v, ok := s.at(i)
				if !ok {
					flush(i - 1)
					continue
				}
				run = append(run, num(x(i))+","+num(y(v)))
			}
			flush(n - 1)
		}
	}
	b.WriteString(`</svg>`)
	return template.HTML(b.String())
}

func label(labels []string, i int) string {
	if i < len(labels) {
		return labels[i]
	}
	return ""
}

func uniq(is ...int) []int {
	var out []int
	for _, i := range is {
		if len(out) == 0 || out[len(out)-1] != i {
			out = append(out, i)
		}
	}
	return out
}

// Row is one bucket's numbers, for a table beside the chart.
type Row struct {
	Label string
	// Cells holds each series' value, formatted; "–" where there is none.
	Cells []string
}

// Rows returns one row per bucket, in order.
func (c Chart) Rows() []Row {
	out := make([]Row, c.buckets())
	for i := range out {
		out[i].Label = label(c.Labels, i)
		for _, s := range c.Series {
			cell := "–"
			if v, ok := s.at(i); ok {
				cell = c.format(v)
			}
			out[i].Cells = append(out[i].Cells, cell)
		}
	}
	return out
}
