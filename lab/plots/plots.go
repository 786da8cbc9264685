// Package plots renders the PNG charts of the benchmark report (`kvrouter
// bench replay`), which compares routing policies ("modes"): latency CDFs,
// time series and grids of time series with one panel per mode.
package plots

import (
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// Series is one named line.
type Series struct {
	Name string
	X, Y []float64 // same length
}

// Panel is one chart of a figure.
type Panel struct {
	Title          string
	XLabel, YLabel string
	Series         []Series
	LogX           bool     // logarithmic x axis (values <= 0 are dropped)
	YMin, YMax     *float64 // fixed y range when non-nil
}

const (
	// Single charts are wide rather than tall because the x axis (latency,
	// time) carries the detail the reader compares.
	chartWidth  = 8 * vg.Inch
	chartHeight = 5 * vg.Inch

	// Grid panels are smaller than single charts so that a grid of one
	// panel per mode still fits a screen.
	panelWidth  = 5 * vg.Inch
	panelHeight = 3.5 * vg.Inch

	// gridTitleHeight is reserved above the tiles of a Grid for its title.
	gridTitleHeight = 0.4 * vg.Inch

	// legendGap separates a plot from its legend.
	legendGap vg.Length = 6 // points

	// maxCDFPoints bounds the points of one CDF curve: rendering cost grows
	// with the points, while a chart a few hundred pixels tall cannot show
	// steps finer than about 1/1000 anyway.
	maxCDFPoints = 2000
)

// palette holds colours that stay distinguishable for the nine or so routing
// modes of a report (the Tableau 10 palette); plotutil's default palette has
// only seven, so modes would share colours.
var palette = []color.Color{
	color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff}, // blue
	color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff}, // orange
	color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff}, // green
	color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff}, // red
	color.RGBA{R: 0x94, G: 0x67, B: 0xbd, A: 0xff}, // purple
	color.RGBA{R: 0x8c, G: 0x56, B: 0x4b, A: 0xff}, // brown
	color.RGBA{R: 0xe3, G: 0x77, B: 0xc2, A: 0xff}, // pink
	color.RGBA{R: 0x7f, G: 0x7f, B: 0x7f, A: 0xff}, // grey
	color.RGBA{R: 0xbc, G: 0xbd, B: 0x22, A: 0xff}, // olive
	color.RGBA{R: 0x17, G: 0xbe, B: 0xcf, A: 0xff}, // cyan
}

// lineStyle returns the style of the i-th series. The style depends on the
// series' position only, not on which series are empty, so that a series
// keeps its colour across the panels of a Grid and across charts. Past the
// palette, dashes keep series apart.
func lineStyle(i int) draw.LineStyle {
	sty := draw.LineStyle{
		Color: palette[i%len(palette)],
		Width: vg.Points(1.5),
	}
	if i >= len(palette) {
		d := vg.Points(float64(2 + 2*(i/len(palette))))
		sty.Dashes = []vg.Length{d, vg.Points(2)}
	}
	return sty
}

// CDF renders, in one chart, the empirical cumulative distribution of each
// named sample set (e.g. TTFT in ms per routing mode): x = value, y = fraction
// of samples <= x, in [0,1]. Series are drawn in the order of names.
// With logX, samples <= 0 still count in the fractions but are not drawn.
func CDF(path, title, xlabel string, names []string, samples map[string][]float64, logX bool) error {
	p := newPlot(title, xlabel, "fraction of samples ≤ x")

	var xs []float64
	for i, name := range names {
		pts := cdfPoints(samples[name], maxCDFPoints)
		if len(pts) == 0 {
			continue
		}
		// Start the curve at 0 so the first step is drawn as a rise, as
		// for any other sample.
		pts = slices.Insert(pts, 0, plotter.XY{X: pts[0].X, Y: 0})
		if logX {
			// Points at x <= 0 are dropped only after the fractions are
			// computed, so that y stays the fraction of all samples.
			pts = slices.DeleteFunc(pts, func(q plotter.XY) bool { return q.X <= 0 })
			if len(pts) == 0 {
				continue
			}
		}
		l, err := plotter.NewLine(pts)
		if err != nil {
			return fmt.Errorf("plots: CDF %q: %w", name, err)
		}
		// The empirical CDF is right-continuous: it holds its value up to
		// the next sample, then jumps.
		l.StepStyle = plotter.PostStep
		l.LineStyle = lineStyle(i)
		p.Add(l)
		p.Legend.Add(name, l)
		for _, q := range pts {
			xs = append(xs, q.X)
		}
	}
	if logX {
		setLogX(p, xs)
	}
	p.Y.Min, p.Y.Max = 0, 1
	return render(path, "", [][]*plot.Plot{{p}}, chartWidth, chartHeight)
}

// cdfPoints returns the points of the empirical CDF of samples, one per
// distinct value v: (v, fraction of samples <= v), sorted by v. Non-finite
// samples are ignored. When there are more than maxPoints distinct values,
// only points at least about 1/maxPoints apart in fraction are kept (and
// always the first and the last), so the curve's shape is kept while the
// cost of drawing it no longer grows with the sample count.
func cdfPoints(samples []float64, maxPoints int) plotter.XYs {
	vals := make([]float64, 0, len(samples))
	for _, v := range samples {
		if finite(v) {
			vals = append(vals, v)
		}
	}
	if len(vals) == 0 {
		return nil
	}
	slices.Sort(vals)

	distinct := 1
	for i := 1; i < len(vals); i++ {
		if vals[i] != vals[i-1] {
			distinct++
		}
	}
	step := 0.0 // keep every point
	if distinct > maxPoints && maxPoints > 1 {
		step = 1 / float64(maxPoints-1)
	}

	n := float64(len(vals))
	pts := make(plotter.XYs, 0, min(distinct, max(maxPoints, 2)))
	last := math.Inf(-1)
	for i := 0; i < len(vals); {
		j := i + 1
		for j < len(vals) && vals[j] == vals[i] {
			j++
		}
		y := float64(j) / n
		if j == len(vals) || y-last >= step {
			pts = append(pts, plotter.XY{X: vals[i], Y: y})
			last = y
		}
		i = j
	}
	return pts
}

// Lines renders one panel to path.
func Lines(path string, p Panel) error {
	pl, err := panelPlot(p)
	if err != nil {
		return err
	}
	return render(path, "", [][]*plot.Plot{{pl}}, chartWidth, chartHeight)
}

// Bars renders one bar per name, e.g. each routing mode's goodput, with
// its value written above it.
func Bars(path, title, ylabel string, names []string, values []float64) error {
	if len(names) != len(values) || len(names) == 0 {
		return fmt.Errorf("plots: %d bar names for %d values", len(names), len(values))
	}
	pl := newPlot(title, "", ylabel)
	pl.X.Tick.Marker = nil
	vs := make(plotter.Values, len(values))
	labels := make([]string, len(values))
	for i, v := range values {
		if !finite(v) {
			v = 0
		}
		vs[i] = v
		labels[i] = fmt.Sprintf("%.3g", v)
	}
	b, err := plotter.NewBarChart(vs, vg.Points(24))
	if err != nil {
		return fmt.Errorf("plots: %s: %w", path, err)
	}
	b.LineStyle.Width = 0
	b.Color = lineStyle(0).Color
	pl.Add(b)
	pl.NominalX(names...)
	if l, err := plotter.NewLabels(plotter.XYLabels{XYs: barTops(vs), Labels: labels}); err == nil {
		for i := range l.TextStyle {
			l.TextStyle[i].XAlign = draw.XCenter
		}
		pl.Add(l)
	}
	pl.Y.Min = 0
	pl.X.Min, pl.X.Max = -0.6, float64(len(names))-0.4
	return render(path, "", [][]*plot.Plot{{pl}}, max(chartWidth, vg.Length(len(names))*vg.Points(80)), chartHeight)
}

func barTops(vs plotter.Values) plotter.XYs {
	xy := make(plotter.XYs, len(vs))
	for i, v := range vs {
		xy[i] = plotter.XY{X: float64(i), Y: v}
	}
	return xy
}

// Grid renders several panels tiled in `cols` columns (rows as needed) into
// one PNG, e.g. per-worker load over time with one panel per mode.
// cols is clamped to [1, len(panels)] so that the image is not wider than
// its panels need.
func Grid(path, title string, cols int, panels []Panel) error {
	cols = max(1, min(cols, len(panels)))
	rows := max(1, (len(panels)+cols-1)/cols)

	plots := make([][]*plot.Plot, rows)
	for r := range plots {
		plots[r] = make([]*plot.Plot, cols)
	}
	for i, p := range panels {
		pl, err := panelPlot(p)
		if err != nil {
			return err
		}
		plots[i/cols][i%cols] = pl
	}

	return render(path, title, plots, panelWidth, panelHeight)
}

// render draws plots, a grid of rows of equally many (possibly nil) plots,
// each in a tileW x tileH tile, under title, as a PNG to path.
func render(path, title string, plots [][]*plot.Plot, tileW, tileH vg.Length) error {
	rows, cols := len(plots), len(plots[0])
	w := vg.Length(cols) * tileW
	h := vg.Length(rows) * tileH
	if title != "" {
		h += gridTitleHeight
	}
	img := vgimg.New(w, h)
	dc := draw.New(img)
	if title != "" {
		sty := draw.TextStyle{
			Color:   color.Black,
			Font:    font.From(plot.DefaultFont, 16),
			XAlign:  draw.XCenter,
			YAlign:  draw.YCenter,
			Handler: plot.DefaultTextHandler,
		}
		dc.FillText(sty, vg.Point{X: w / 2, Y: h - gridTitleHeight/2}, title)
		dc = draw.Crop(dc, 0, 0, 0, -gridTitleHeight)
	}

	// gonum draws legends over the data, where they hide lines whatever
	// the corner; they go in a strip right of each plot instead, as wide
	// as the widest legend so that all plots keep the same data width.
	legends := make([][]plot.Legend, rows)
	var legendW vg.Length
	for r := range plots {
		legends[r] = make([]plot.Legend, cols)
		for c, pl := range plots[r] {
			if pl == nil {
				continue
			}
			legends[r][c] = pl.Legend
			pl.Legend = plot.NewLegend()
			lr := legends[r][c].Rectangle(draw.Canvas{})
			legendW = max(legendW, lr.Max.X-lr.Min.X)
		}
	}
	if legendW > 0 {
		legendW += legendGap
	}

	tiles := draw.Tiles{
		Rows: rows, Cols: cols,
		PadX: vg.Points(12) + legendW, PadY: vg.Points(12),
		PadTop: vg.Points(4), PadBottom: vg.Points(4),
		PadLeft: vg.Points(4), PadRight: vg.Points(8) + legendW,
	}
	// Align rather than Tiles.At so the data areas of all panels line up
	// even when their tick labels differ in width, which makes the panels
	// comparable at a glance.
	canvases := plot.Align(plots, tiles, dc)
	for r := range plots {
		for c, pl := range plots[r] {
			if pl == nil {
				continue
			}
			cv := canvases[r][c]
			pl.Draw(cv)
			leg := legends[r][c]
			leg.Top, leg.Left = true, true
			// Start level with the top of the data area, below the title.
			top := cv.Max.Y
			if pl.Title.Text != "" {
				top -= pl.Title.TextStyle.Rectangle(pl.Title.Text).Size().Y + pl.Title.Padding
			}
			leg.Draw(draw.Canvas{Canvas: cv.Canvas, Rectangle: vg.Rectangle{
				Min: vg.Point{X: cv.Max.X + legendGap, Y: cv.Min.Y},
				Max: vg.Point{X: cv.Max.X + legendW, Y: top},
			}})
		}
	}

	f, err := create(path)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return fmt.Errorf("plots: write %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("plots: write %s: %w", path, err)
	}
	return nil
}

// panelPlot builds the plot of one panel, skipping empty series and
// non-finite points.
func panelPlot(p Panel) (*plot.Plot, error) {
	pl := newPlot(p.Title, p.XLabel, p.YLabel)

	var xs []float64
	for i, s := range p.Series {
		if len(s.X) != len(s.Y) {
			return nil, fmt.Errorf("plots: series %q of panel %q: %d x values but %d y values",
				s.Name, p.Title, len(s.X), len(s.Y))
		}
		pts := make(plotter.XYs, 0, len(s.X))
		for j, x := range s.X {
			y := s.Y[j]
			if !finite(x) || !finite(y) || (p.LogX && x <= 0) {
				continue
			}
			pts = append(pts, plotter.XY{X: x, Y: y})
		}
		if len(pts) == 0 {
			continue
		}
		l, err := plotter.NewLine(pts)
		if err != nil {
			return nil, fmt.Errorf("plots: series %q of panel %q: %w", s.Name, p.Title, err)
		}
		l.LineStyle = lineStyle(i)
		pl.Add(l)
		if s.Name != "" {
			pl.Legend.Add(s.Name, l)
		}
		for _, q := range pts {
			xs = append(xs, q.X)
		}
	}
	if p.LogX {
		setLogX(pl, xs)
	}
	if p.YMin != nil {
		pl.Y.Min = *p.YMin
	}
	if p.YMax != nil {
		pl.Y.Max = *p.YMax
	}
	return pl, nil
}

// newPlot returns a plot with the styling shared by all charts.
func newPlot(title, xlabel, ylabel string) *plot.Plot {
	p := plot.New()
	p.Title.Text = title
	p.Title.Padding = vg.Points(6)
	p.X.Label.Text = xlabel
	p.Y.Label.Text = ylabel
	p.X.Tick.Marker = linTicks{}
	p.Y.Tick.Marker = linTicks{}
	p.Add(plotter.NewGrid())
	return p
}

// setLogX switches p's x axis to a log scale over xs, all of which must be
// positive. With no xs the axis stays linear, because a log scale of an
// empty range has no valid bounds and gonum panics on it.
func setLogX(p *plot.Plot, xs []float64) {
	if len(xs) == 0 {
		return
	}
	lo, hi := slices.Min(xs), slices.Max(xs)
	if lo == hi {
		// gonum widens an empty range by ±1, which can cross zero; widen by
		// a factor instead.
		lo, hi = lo/2, hi*2
	}
	p.X.Min, p.X.Max = lo, hi
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = logTicks{}
}

// logTicks marks a log axis. Unlike plot.LogTicks, which labels powers of
// ten only, it falls back to labelling 2 and 5 times them, then every
// multiple, when that gives fewer than two labels, because a latency CDF
// often lies within one decade and would otherwise get no labels at all.
type logTicks struct{}

// Ticks implements plot.Ticker.
func (logTicks) Ticks(lo, hi float64) []plot.Tick {
	if lo <= 0 || hi <= 0 || lo >= hi {
		return nil
	}
	first := math.Floor(math.Log10(lo))
	last := math.Ceil(math.Log10(hi))
	for _, labelled := range [][]int{{1}, {1, 2, 5}, {1, 2, 3, 4, 5, 6, 7, 8, 9}} {
		var ticks []plot.Tick
		labels := 0
		for e := first; e <= last; e++ {
			decade := math.Pow(10, e)
			for m := 1; m < 10; m++ {
				v := float64(m) * decade
				if v < lo || v > hi {
					continue
				}
				t := plot.Tick{Value: v}
				if slices.Contains(labelled, m) {
					// Six digits hide float noise such as 0.30000000000000004.
					t.Label = strconv.FormatFloat(v, 'g', 6, 64)
					labels++
				}
				ticks = append(ticks, t)
			}
		}
		// Two labels are the fewest that let the reader infer the scale;
		// stopping at the first set that has them keeps wide ranges from
		// getting crowded labels.
		if labels >= 2 {
			return ticks
		}
	}
	// The range lies between two consecutive integer multiples of a power
	// of ten: ticks placed as on a linear axis are the only useful ones.
	return plot.DefaultTicks{}.Ticks(lo, hi)
}

// linTicks marks a linear axis with about five labelled ticks at round
// values, labelled without needless decimals: gonum's default aims at three
// and labels them with a fixed precision ("250.00"), too coarse to read
// values off a report's chart.
type linTicks struct{}

// Ticks implements plot.Ticker.
func (linTicks) Ticks(lo, hi float64) []plot.Tick {
	if !(lo < hi) || !finite(lo) || !finite(hi) {
		return nil
	}
	const target = 5
	raw := (hi - lo) / target
	exp := math.Floor(math.Log10(raw))
	mag := math.Pow(10, exp)
	step := mag
	for _, m := range []float64{2, 5, 10} {
		// Nearest in ratio, so the label count stays close to target.
		if math.Abs(math.Log(m*mag/raw)) < math.Abs(math.Log(step/raw)) {
			step = m * mag
		}
	}
	decimals := max(0, int(-math.Floor(math.Log10(step))))
	big := max(math.Abs(lo), math.Abs(hi)) >= 1e6
	minor := step / 2

	// The slack keeps ticks at the ends of the range despite rounding in
	// the divisions (4.1/0.025 is not exactly 164).
	const slack = 1e-9
	var ticks []plot.Tick
	for k := math.Ceil(lo/minor - slack); k <= hi/minor+slack; k++ {
		v := min(max(k*minor, lo), hi)
		t := plot.Tick{Value: v}
		if math.Mod(k, 2) == 0 {
			switch {
			case big:
				t.Label = strconv.FormatFloat(v, 'g', 6, 64)
			case v == 0:
				t.Label = "0" // not "-0" when v is -0
			default:
				t.Label = strconv.FormatFloat(v, 'f', decimals, 64)
			}
		}
		ticks = append(ticks, t)
	}
	return ticks
}

// create creates path and its parent directory.
func create(path string) (*os.File, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("plots: %w", err)
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("plots: %w", err)
	}
	return f, nil
}

func finite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }
