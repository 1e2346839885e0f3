package chart

import (
	"encoding/xml"
	"errors"
	"io"
	"math"
	"strings"
	"testing"
)

// parse checks that svg is well-formed XML and returns its elements' names and the values of
// every attribute, in order.
func parse(t *testing.T, svg string) (elements []string, attrs []string) {
	t.Helper()
	d := xml.NewDecoder(strings.NewReader(svg))
	d.Strict = true
	for {
		tok, err := d.Token()
		if errors.Is(err, io.EOF) {
			return elements, attrs
		}
		if err != nil {
			t.Fatalf("not well-formed XML: %v\n%s", err, svg)
		}
		if se, ok := tok.(xml.StartElement); ok {
			elements = append(elements, se.Name.Local)
			for _, a := range se.Attr {
				attrs = append(attrs, a.Value)
			}
		}
	}
}

func count(elements []string, name string) int {
	n := 0
	for _, e := range elements {
		if e == name {
			n++
		}
	}
	return n
}

func labels(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = strings.Repeat("x", i%3)
	}
	return out
}

func TestSVGIsWellFormedWhateverTheValues(t *testing.T) {
	nan, inf := math.NaN(), math.Inf(1)
	cases := map[string][]float64{
		"all zero":           make([]float64, 60),
		"single point":       {7},
		"single point, gaps": {nan, nan, 3, nan},
		"no data":            {nan, nan, nan},
		"infinities":         {inf, math.Inf(-1), 1, inf},
		"negative":           {-5, -1e300, 2},
		"huge":               {math.MaxFloat64, math.MaxFloat64},
		"tiny":               {math.SmallestNonzeroFloat64, 1e-300},
		"empty":              nil,
	}
	for name, values := range cases {
		for _, kind := range []Kind{Bars, Lines} {
			c := Chart{ID: "c", Title: "t", Desc: "d", Labels: labels(len(values)), Kind: kind, Integer: kind == Bars,
				Series: []Series{{Name: "a", Class: "a", Values: values}, {Name: "b", Class: "b", Values: values}}}
			svg := string(c.SVG())
			elements, attrs := parse(t, svg)
			if elements[0] != "svg" || count(elements, "title") < 1 || count(elements, "desc") != 1 {
				t.Errorf("%s (kind %d): elements %v", name, kind, elements)
			}
			for _, a := range attrs {
				if strings.Contains(a, "NaN") || strings.Contains(a, "Inf") || strings.Contains(a, "e+") {
					t.Errorf("%s (kind %d): attribute %q", name, kind, a)
				}
			}
			for _, r := range c.Rows() {
				for _, cell := range r.Cells {
					if strings.Contains(cell, "NaN") || strings.Contains(cell, "Inf") {
						t.Errorf("%s: table cell %q", name, cell)
					}
				}
			}
		}
	}
}

func TestSVGDrawsData(t *testing.T) {
	nan := math.NaN()
	bars := Chart{ID: "f", Labels: labels(4), Kind: Bars, Series: []Series{
		{Name: "ok", Class: "completed", Values: []float64{1, 0, 2, nan}},
		{Name: "bad", Class: "failed", Values: []float64{1, 0, 0, 3}},
	}}
	elements, _ := parse(t, string(bars.SVG()))
	if got := count(elements, "rect"); got != 4 { // zeros and gaps draw nothing
		t.Errorf("%d bars, want 4", got)
	}
	// A gap splits a line; a value alone between gaps is a dot.
	lines := Chart{ID: "l", Labels: labels(6), Kind: Lines, Series: []Series{
		{Name: "p50", Class: "p50", Values: []float64{1, 2, nan, 4, nan, 5}},
	}}
	elements, _ = parse(t, string(lines.SVG()))
	if count(elements, "polyline") != 1 || count(elements, "circle") != 2 {
		t.Errorf("lines: %v", elements)
	}
	if bars.Empty() || lines.Empty() {
		t.Error("charts with data reported empty")
	}
	if !(Chart{Series: []Series{{Values: []float64{nan, -1}}}}).Empty() {
		t.Error("a chart without drawable values is not empty")
	}
	rows := bars.Rows()
	if len(rows) != 4 || rows[3].Cells[0] != "–" || rows[3].Cells[1] != "3" || rows[0].Cells[0] != "1" {
		t.Errorf("rows %+v", rows)
	}
}

// Text is escaped and ids and classes are cut to safe characters.
func TestSVGEscapes(t *testing.T) {
	bait := `"><script>alert(1)</script>`
	c := Chart{ID: `x" onload="alert(1)`, Title: bait, Desc: bait, Labels: []string{bait, bait}, Kind: Bars,
		Series: []Series{{Name: bait, Class: `a" onclick="x`, Values: []float64{1, 2}}},
		Format: func(float64) string { return bait }}
	svg := string(c.SVG())
	parse(t, svg)
	if strings.Contains(svg, "<script") || strings.Contains(svg, `onload="`) || strings.Contains(svg, `onclick="`) {
		t.Fatalf("unescaped: %s", svg)
	}
}

func TestNiceCeil(t *testing.T) {
	cases := map[float64]float64{0: 1, -3: 1, 0.3: 0.5, 1: 1, 1.01: 2, 3: 5, 7: 10, 10: 10, 11: 20, 4500: 5000,
		math.NaN(): 1, math.Inf(1): 1}
	for in, want := range cases {
		if got := niceCeil(in); math.Abs(got-want) > 1e-9*want {
			t.Errorf("niceCeil(%v) = %v, want %v", in, got, want)
		}
	}
}

func TestEvenCeil(t *testing.T) {
	cases := map[float64]float64{0: 2, 1: 2, 2: 2, 2.5: 4, 3: 4, 5: 10, 10: 10, 11: 20, 25: 40, 41: 100, 4500: 10000,
		math.NaN(): 2, math.Inf(1): 2, math.MaxFloat64: math.MaxFloat64}
	for in, want := range cases {
		if got := evenCeil(in); math.Abs(got-want) > 1e-9*want {
			t.Errorf("evenCeil(%v) = %v, want %v", in, got, want)
		}
	}
}
