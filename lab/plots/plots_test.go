package plots

import (
	"fmt"
	"image"
	"image/color"
	"image/png"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/vgimg"
)

// minLinePixels is well above what a legend thumbnail alone paints (about
// 27x2 pixels), so reaching it means the series itself was drawn.
const minLinePixels = 300

func TestCDFPoints(t *testing.T) {
	nan, inf := math.NaN(), math.Inf(1)
	tests := []struct {
		name    string
		samples []float64
		want    plotter.XYs
	}{
		{"nil", nil, nil},
		{"empty", []float64{}, nil},
		{"only non-finite", []float64{nan, inf, -inf}, nil},
		{"duplicates", []float64{3, 1, 2, 2}, plotter.XYs{{X: 1, Y: 0.25}, {X: 2, Y: 0.75}, {X: 3, Y: 1}}},
		{"single value", []float64{5, 5, 5}, plotter.XYs{{X: 5, Y: 1}}},
		{"non-finite skipped", []float64{nan, 2, inf, 1, -inf}, plotter.XYs{{X: 1, Y: 0.5}, {X: 2, Y: 1}}},
		{"negative", []float64{0, -1, 1, -1}, plotter.XYs{{X: -1, Y: 0.5}, {X: 0, Y: 0.75}, {X: 1, Y: 1}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := slices.Clone(tt.samples)
			got := cdfPoints(tt.samples, maxCDFPoints)
			if !slices.Equal(got, tt.want) {
				t.Errorf("cdfPoints(%v) = %v, want %v", tt.samples, got, tt.want)
			}
			// Callers hand in their result slices: sorting them in place
			// would corrupt the report's other statistics.
			if !slices.EqualFunc(in, tt.samples, sameFloat) {
				t.Errorf("cdfPoints modified its input: %v, was %v", tt.samples, in)
			}
		})
	}
}

func TestCDFPointsDownsample(t *testing.T) {
	const n, maxPoints = 100_000, 2000
	rng := rand.New(rand.NewPCG(1, 2))
	tests := []struct {
		name       string
		samples    []float64
		wantPoints int // exact count when > 0
	}{
		{"distinct exponential", randSamples(rng, n), 0},
		{"few distinct values kept exactly", func() []float64 {
			s := make([]float64, n)
			for i := range s {
				s[i] = float64(rng.IntN(maxPoints)) // at most maxPoints distinct
			}
			return s
		}(), maxPoints},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := cdfPoints(tt.samples, maxPoints)
			if tt.wantPoints > 0 && len(got) != tt.wantPoints {
				t.Fatalf("got %d points, want %d", len(got), tt.wantPoints)
			}
			if len(got) > maxPoints || len(got) < maxPoints/2 {
				t.Fatalf("got %d points, want between %d and %d", len(got), maxPoints/2, maxPoints)
			}
			if first, lo := got[0].X, slices.Min(tt.samples); first != lo {
				t.Errorf("first point x = %v, want the minimum %v", first, lo)
			}
			if last, hi := got[len(got)-1], slices.Max(tt.samples); last.X != hi || last.Y != 1 {
				t.Errorf("last point = %v, want (%v, 1)", last, hi)
			}
			// The curve must keep its shape: no jump in fraction much
			// larger than the resolution asked for, and both coordinates
			// strictly increasing.
			maxGap := 1.0/float64(maxPoints-1) + 1.0/n
			for i := 1; i < len(got); i++ {
				a, b := got[i-1], got[i]
				if b.X <= a.X || b.Y <= a.Y {
					t.Fatalf("points %d, %d not increasing: %v, %v", i-1, i, a, b)
				}
				if tt.wantPoints == 0 && b.Y-a.Y > 2*maxGap {
					t.Fatalf("gap %v between points %d and %d exceeds %v", b.Y-a.Y, i-1, i, 2*maxGap)
				}
			}
		})
	}
}

func TestCDF(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	names := []string{"kv", "round_robin", "random"}
	samples := map[string][]float64{
		"kv":          randSamples(rng, 5000),
		"round_robin": scaled(randSamples(rng, 5000), 3),
		"random":      append(scaled(randSamples(rng, 5000), 10), 0, -1, math.NaN()),
	}
	for _, logX := range []bool{false, true} {
		t.Run(fmt.Sprintf("logX=%v", logX), func(t *testing.T) {
			// A missing parent directory must be created.
			path := filepath.Join(t.TempDir(), "a", "b", "ttft.png")
			if err := CDF(path, "TTFT", "TTFT (ms)", names, samples, logX); err != nil {
				t.Fatal(err)
			}
			img := decode(t, path)
			checkSize(t, img, chartWidth, chartHeight)
			for i := range names {
				checkColour(t, img, img.Bounds(), palette[i], minLinePixels)
			}
			// No series was given a fourth colour.
			if got := countNear(img, img.Bounds(), palette[3]); got != 0 {
				t.Errorf("%d pixels of unused colour %v", got, palette[3])
			}
		})
	}
}

func TestLines(t *testing.T) {
	lo, hi := 0.0, 10.0
	xs := make([]float64, 200)
	for i := range xs {
		xs[i] = float64(i + 1)
	}
	tests := []struct {
		name  string
		panel Panel
		want  []int // palette indices that must be drawn
	}{
		{"linear", Panel{
			Title: "load", XLabel: "time (s)", YLabel: "active blocks",
			Series: []Series{
				{Name: "w0", X: xs, Y: apply(xs, func(x float64) float64 { return x / 40 })},
				{Name: "w1", X: xs, Y: apply(xs, func(x float64) float64 { return 5 + 4*math.Sin(x/10) })},
			},
			YMin: &lo, YMax: &hi,
		}, []int{0, 1}},
		{"log x, empty and non-finite skipped", Panel{
			Title: "log", XLabel: "x", YLabel: "y", LogX: true,
			Series: []Series{
				{Name: "empty"},
				{Name: "w1", X: append([]float64{-1, 0, math.NaN()}, xs...),
					Y: append([]float64{1, 1, 1}, apply(xs, math.Sqrt)...)},
				{Name: "w2", X: xs, Y: apply(xs, func(x float64) float64 {
					if int(x)%10 == 0 {
						return math.Inf(1)
					}
					return math.Log(x)
				})},
			},
		}, []int{1, 2}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "lines.png")
			if err := Lines(path, tt.panel); err != nil {
				t.Fatal(err)
			}
			img := decode(t, path)
			checkSize(t, img, chartWidth, chartHeight)
			for _, c := range tt.want {
				checkColour(t, img, img.Bounds(), palette[c], minLinePixels)
			}
		})
	}
}

func TestLinesMismatchedLengths(t *testing.T) {
	p := Panel{Series: []Series{{Name: "bad", X: []float64{1, 2}, Y: []float64{1}}}}
	path := filepath.Join(t.TempDir(), "bad.png")
	if err := Lines(path, p); err == nil {
		t.Error("Lines with len(X) != len(Y): got nil error")
	}
	if err := Grid(path, "", 1, []Panel{p}); err == nil {
		t.Error("Grid with len(X) != len(Y): got nil error")
	}
}

func TestGrid(t *testing.T) {
	xs := []float64{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	// Panel i draws one series, in colour i: it follows i empty series,
	// which must be skipped without shifting the colours. So the colours
	// tell which panel landed in which tile.
	panel := func(i int) Panel {
		p := Panel{Title: fmt.Sprintf("mode %d", i), XLabel: "time (s)", YLabel: "load"}
		for j := range i {
			p.Series = append(p.Series, Series{Name: fmt.Sprintf("empty%d", j)})
		}
		p.Series = append(p.Series, Series{Name: "w", X: xs, Y: apply(xs, func(x float64) float64 { return x * x })})
		return p
	}
	tests := []struct {
		name        string
		title       string
		cols        int
		panels      int
		rows, cols2 int // expected layout
	}{
		{"2x2 with hole", "per-worker load", 2, 3, 2, 2},
		{"one row", "", 3, 3, 1, 3},
		{"cols clamped to panels", "t", 5, 2, 1, 2},
		{"cols below one", "t", 0, 2, 2, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var panels []Panel
			for i := range tt.panels {
				panels = append(panels, panel(i))
			}
			path := filepath.Join(t.TempDir(), "grid.png")
			if err := Grid(path, tt.title, tt.cols, panels); err != nil {
				t.Fatal(err)
			}
			img := decode(t, path)
			titleH := vg.Length(0)
			if tt.title != "" {
				titleH = gridTitleHeight
			}
			checkSize(t, img, vg.Length(tt.cols2)*panelWidth, vg.Length(tt.rows)*panelHeight+titleH)

			// Panel i must be drawn in tile i (row-major) and nowhere else,
			// and the hole left by a missing panel must stay empty.
			top := pixels(titleH)
			tileW, tileH := pixels(panelWidth), pixels(panelHeight)
			for i := range tt.rows * tt.cols2 {
				r, c := i/tt.cols2, i%tt.cols2
				tile := image.Rect(c*tileW, top+r*tileH, (c+1)*tileW, top+(r+1)*tileH)
				for k := range tt.panels {
					n := countNear(img, tile, palette[k])
					if k == i && n < minLinePixels {
						t.Errorf("tile (%d,%d): %d pixels of colour %d, want >= %d", r, c, n, k, minLinePixels)
					}
					if k != i && n != 0 {
						t.Errorf("tile (%d,%d): %d pixels of colour %d, want 0", r, c, n, k)
					}
				}
			}
		})
	}
}

// TestEmpty checks that missing data yields an empty chart, not an error
// or a panic: a report must still be written when a mode produced nothing.
func TestEmpty(t *testing.T) {
	only := map[string][]float64{"a": {}, "b": {math.NaN()}, "c": {0, -5}}
	tests := []struct {
		name   string
		render func(path string) error
		w, h   vg.Length
	}{
		{"CDF nil", func(p string) error { return CDF(p, "", "", nil, nil, false) }, chartWidth, chartHeight},
		{"CDF unknown names", func(p string) error { return CDF(p, "t", "x", []string{"x", "y"}, nil, false) }, chartWidth, chartHeight},
		{"CDF empty sets", func(p string) error { return CDF(p, "t", "x", []string{"a", "b"}, only, false) }, chartWidth, chartHeight},
		{"CDF log only non-positive", func(p string) error { return CDF(p, "t", "x", []string{"a", "b", "c"}, only, true) }, chartWidth, chartHeight},
		{"CDF log single value", func(p string) error {
			return CDF(p, "t", "x", []string{"v"}, map[string][]float64{"v": {0.5}}, true)
		}, chartWidth, chartHeight},
		{"Lines zero panel", func(p string) error { return Lines(p, Panel{}) }, chartWidth, chartHeight},
		{"Lines empty series", func(p string) error {
			return Lines(p, Panel{LogX: true, Series: []Series{{Name: "a"}, {Name: "b", X: []float64{0}, Y: []float64{1}}}})
		}, chartWidth, chartHeight},
		{"Grid nil", func(p string) error { return Grid(p, "", 3, nil) }, panelWidth, panelHeight},
		{"Grid empty panels", func(p string) error { return Grid(p, "", 2, []Panel{{}, {LogX: true}}) }, 2 * panelWidth, panelHeight},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "empty.png")
			if err := tt.render(path); err != nil {
				t.Fatal(err)
			}
			checkSize(t, decode(t, path), tt.w, tt.h)
		})
	}
}

func TestLogTicks(t *testing.T) {
	tests := []struct {
		lo, hi float64
		want   []string // labels, in order; nil means "at least two"
	}{
		{1, 1e4, []string{"1", "10", "100", "1000", "10000"}},
		{3, 800, []string{"10", "100"}},
		{200, 800, []string{"200", "500"}},
		{0.25, 0.45, []string{"0.3", "0.4"}},
		{310, 390, nil},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%v-%v", tt.lo, tt.hi), func(t *testing.T) {
			var labels []string
			for _, tk := range (logTicks{}).Ticks(tt.lo, tt.hi) {
				if tk.Label != "" {
					labels = append(labels, tk.Label)
				}
			}
			if tt.want == nil {
				if len(labels) < 2 {
					t.Errorf("labels %q, want at least two", labels)
				}
				return
			}
			if !slices.Equal(labels, tt.want) {
				t.Errorf("labels %q, want %q", labels, tt.want)
			}
		})
	}
}

func TestLinTicks(t *testing.T) {
	tests := []struct {
		lo, hi float64
		want   []string
	}{
		{0, 1, []string{"0", "0.2", "0.4", "0.6", "0.8", "1.0"}},
		{0, 14000, []string{"0", "2000", "4000", "6000", "8000", "10000", "12000", "14000"}},
		{-0.5, 0.5, []string{"-0.4", "-0.2", "0", "0.2", "0.4"}},
		{3.7, 4.1, []string{"3.7", "3.8", "3.9", "4.0", "4.1"}},
		{1e6, 4e6, []string{"1e+06", "1.5e+06", "2e+06", "2.5e+06", "3e+06", "3.5e+06", "4e+06"}},
		{1, 1, nil},
		{math.Inf(-1), 1, nil},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%v-%v", tt.lo, tt.hi), func(t *testing.T) {
			var labels []string
			for _, tk := range (linTicks{}).Ticks(tt.lo, tt.hi) {
				if tk.Value < tt.lo || tk.Value > tt.hi {
					t.Errorf("tick %v outside [%v, %v]", tk.Value, tt.lo, tt.hi)
				}
				if tk.Label != "" {
					labels = append(labels, tk.Label)
				}
			}
			if !slices.Equal(labels, tt.want) {
				t.Errorf("labels %q, want %q", labels, tt.want)
			}
		})
	}
}

func BenchmarkCDF(b *testing.B) {
	rng := rand.New(rand.NewPCG(5, 6))
	names := make([]string, 9)
	samples := make(map[string][]float64, len(names))
	for i := range names {
		names[i] = fmt.Sprintf("mode%d", i)
		samples[names[i]] = scaled(randSamples(rng, 100_000), float64(i+1))
	}
	path := filepath.Join(b.TempDir(), "cdf.png")
	for b.Loop() {
		if err := CDF(path, "TTFT", "TTFT (ms)", names, samples, true); err != nil {
			b.Fatal(err)
		}
	}
}

// randSamples returns n latency-like samples: positive, long-tailed.
func randSamples(rng *rand.Rand, n int) []float64 {
	s := make([]float64, n)
	for i := range s {
		s[i] = 20 + 100*rng.ExpFloat64()
	}
	return s
}

func scaled(s []float64, k float64) []float64 {
	return apply(s, func(v float64) float64 { return v * k })
}

func apply(xs []float64, f func(float64) float64) []float64 {
	ys := make([]float64, len(xs))
	for i, x := range xs {
		ys[i] = f(x)
	}
	return ys
}

func sameFloat(a, b float64) bool { return a == b || (math.IsNaN(a) && math.IsNaN(b)) }

func decode(t *testing.T, path string) image.Image {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatalf("decode %s: %v", path, err)
	}
	return img
}

// pixels converts a length to pixels as vgimg sizes its images.
func pixels(l vg.Length) int {
	return int(float64(l/vg.Inch)*vgimg.DefaultDPI + 0.5)
}

func checkSize(t *testing.T, img image.Image, w, h vg.Length) {
	t.Helper()
	got := img.Bounds().Size()
	if want := image.Pt(pixels(w), pixels(h)); got != want {
		t.Errorf("image size %v, want %v", got, want)
	}
}

func checkColour(t *testing.T, img image.Image, r image.Rectangle, c color.Color, min int) {
	t.Helper()
	if n := countNear(img, r, c); n < min {
		t.Errorf("%d pixels of colour %v, want >= %d", n, c, min)
	}
}

// countNear counts the pixels of r close to c. Closeness rather than
// equality, because anti-aliasing blends the edges of lines.
func countNear(img image.Image, r image.Rectangle, c color.Color) int {
	const tol = 24 << 8 // in 16-bit channel units
	cr, cg, cb, _ := c.RGBA()
	near := func(a, b uint32) bool { return max(a, b)-min(a, b) <= tol }
	n := 0
	r = r.Intersect(img.Bounds())
	for y := r.Min.Y; y < r.Max.Y; y++ {
		for x := r.Min.X; x < r.Max.X; x++ {
			pr, pg, pb, _ := img.At(x, y).RGBA()
			if near(pr, cr) && near(pg, cg) && near(pb, cb) {
				n++
			}
		}
	}
	return n
}
