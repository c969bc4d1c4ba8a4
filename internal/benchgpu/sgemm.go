package benchgpu

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"time"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

// SGEMMInfo describes the matrix product of the burn pass.
type SGEMMInfo struct {
	N      int     `json:"n"`
	SoloMs float64 `json:"solo_ms"`
	TFLOPS float64 `json:"tflops"`
	// Skipped says why the burn pass did not run, if it did not.
	Skipped string `json:"skipped,omitempty"`
}

// burnPass measures the burn variants while kvo_sgemm runs on b.burn.
func (b *bench) burnPass(res *ThroughputResults, solo map[string]ThroughputRow) error {
	cfg := b.cfg
	g, info, err := b.soloGemm()
	res.SGEMM = info
	if err != nil || g == nil {
		return err
	}
	byName := map[string]*variant{}
	for _, v := range b.variants {
		byName[v.name] = v
	}
	for _, size := range cfg.SegSizes {
		segs := b.segments(size)
		for _, name := range cfg.BurnVariants {
			v, ok := byName[name]
			if !ok {
				continue
			}
			for _, dir := range []string{"d2h", "h2d", "both"} {
				key := name + "/" + dir + "/" + strconv.FormatUint(size, 10)
				var slow float64
				burn := func(enqueue func(*[]tk) error) (timing, error) {
					tm, s, err := b.besideGemm(g, res.SGEMM.SoloMs, solo[key].soloTiming(cfg.TotalBytes), enqueue)
					slow = s
					return tm, err
				}
				row, err := b.scattered(res, v, dir, size, segs, burn)
				if err != nil {
					return err
				}
				row.Background = "sgemm"
				row.SGEMMSlowdownPct = slow
				if s := solo[key].GBps; s > 0 {
					row.PctOfSolo = 100 * row.GBps / s
				}
				res.Rows = append(res.Rows, row)
			}
		}
	}
	return nil
}

// newGemm loads kvo_sgemm and allocates its BurnN × BurnN matrices; skipped
// says why it cannot run where the PTX lacks it.
func (b *bench) newGemm() (g *gemm, skipped string, err error) {
	drv := b.drv
	mod, skipped, err := b.module()
	if err != nil || skipped != "" {
		return nil, skipped, err
	}
	fn, err := drv.ModuleGetFunction(mod, "kvo_sgemm")
	if err != nil {
		return nil, fmt.Sprintf("kvo_sgemm not in the PTX (regenerate it with `make ptx`): %v", err), nil
	}
	n := uint64(b.cfg.BurnN)
	var mats [3]cuda.DevicePtr
	for i := range mats {
		if mats[i], err = drv.MemAlloc(n * n * 4); err != nil {
			return nil, "", fmt.Errorf("bench: sgemm matrix of %d bytes: %w", n*n*4, err)
		}
		p := mats[i]
		b.onClose(func() error { return drv.MemFree(p) })
		// 0x3c3c3c3c is about 0.0115: finite products, no overflow.
		if err := drv.MemsetD8(p, 0x3c, n*n*4); err != nil {
			return nil, "", err
		}
	}
	return &gemm{drv: drv, fn: fn, s: b.burn, n: uint32(n), args: [][]byte{cuda.Arg(uint64(mats[0])), cuda.Arg(uint64(mats[1])), cuda.Arg(uint64(mats[2])), cuda.Arg(uint32(n))}}, "", nil
}

// soloGemm makes the matrix product (nil, with info.Skipped saying why,
// where the PTX has no kvo_sgemm) and times it alone.
func (b *bench) soloGemm() (g *gemm, info SGEMMInfo, err error) {
	info.N = b.cfg.BurnN
	if g, info.Skipped, err = b.newGemm(); err != nil || g == nil {
		return nil, info, err
	}
	if info.SoloMs, err = g.solo(b.ev[0], b.ev[2], 5); err != nil {
		return nil, info, fmt.Errorf("bench: sgemm solo: %w", err)
	}
	n := float64(info.N)
	info.TFLOPS = 2 * n * n * n / (info.SoloMs * 1e9)
	return g, info, nil
}

// Bounds of the burn pass: timed reps per point (no warm-up: the products
// are already running) and products queued per point.
const (
	burnReps        = 3
	maxBurnLaunches = 600
)

// gemm launches kvo_sgemm.
type gemm struct {
	drv  cuda.Driver
	fn   cuda.Function
	s    cuda.Stream
	n    uint32
	args [][]byte
}

func (g *gemm) launch() error {
	t := g.n / 64
	return g.drv.LaunchKernel(g.fn, cuda.Dim3{X: t, Y: t, Z: 1}, cuda.Dim3{X: 256, Y: 1, Z: 1}, 0, g.s, g.args...)
}

// solo returns the median time of one product alone, over reps.
func (g *gemm) solo(start, end cuda.Event, reps int) (float64, error) {
	times := make([]float64, 0, reps)
	for r := range reps + 1 {
		err := errors.Join(g.drv.EventRecord(start, g.s), g.launch(), g.drv.EventRecord(end, g.s))
		if err == nil {
			err = g.drv.EventSynchronize(end)
		}
		if err != nil {
			return 0, err
		}
		ms, err := g.drv.EventElapsedTime(start, end)
		if err != nil {
			return 0, err
		}
		if r > 0 {
			times = append(times, float64(ms))
		}
	}
	slices.Sort(times)
	return times[len(times)/2], nil
}

// besideGemm runs the timed reps of enqueue, gated as solo's submit time
// asks, while a queue of products runs on the burn stream: the transfers
// start after two products, and the products outlast them. It returns the
// transfer's timing and the mean slowdown (%) of the products that ran
// entirely within a rep's timed window (gates excluded), or, if none did,
// of those that overlapped one.
func (b *bench) besideGemm(g *gemm, soloMs float64, solo timing, enqueue func(*[]tk) error) (tm timing, slowPct float64, err error) {
	drv := b.drv
	reps := min(b.cfg.Reps, burnReps)
	hold := time.Duration(0)
	if b.gate != nil {
		hold = holdFor(solo.submit)
	}
	expectMs := 1.0
	if solo.best > 0 {
		expectMs = (solo.best + float64(hold.Microseconds())/1e3) * float64(reps)
	}
	// Three times the solo transfer time, so the products outlast a
	// transfer slowed by them; bounded to keep the launch queue short.
	count := min(int(math.Ceil(3*expectMs/soloMs))+4, maxBurnLaunches)
	evs := make([]cuda.Event, count+1)
	for i := range evs {
		if evs[i], err = drv.EventCreate(cuda.EventDefault); err != nil {
			return tm, 0, err
		}
		e := evs[i]
		defer func() { err = errors.Join(err, drv.EventDestroy(e)) }()
	}
	for i := range count {
		if err := errors.Join(drv.EventRecord(evs[i], g.s), g.launch()); err != nil {
			return tm, 0, err
		}
	}
	if err := drv.EventRecord(evs[count], g.s); err != nil {
		return tm, 0, err
	}
	for _, s := range b.s {
		if err := drv.StreamWaitEvent(s, evs[2], 0); err != nil {
			return tm, 0, err
		}
	}
	at := func(e cuda.Event) (float64, error) {
		ms, err := drv.EventElapsedTime(evs[0], e)
		return float64(ms), err
	}
	times := make([]float64, 0, reps)
	subs := make([]time.Duration, 0, reps)
	windows := make([][2]float64, 0, reps)
	tm.held = hold > 0
	for range reps {
		r, err := b.measure(enqueue, hold)
		var lo, hi float64
		if err == nil {
			lo, err = at(b.ev[0])
		}
		if err == nil {
			hi, err = at(b.ev[2])
		}
		if err != nil {
			return tm, 0, errors.Join(err, drv.StreamSynchronize(g.s))
		}
		times = append(times, r.ms)
		subs = append(subs, r.submit)
		windows = append(windows, [2]float64{lo, hi})
		tm.held = tm.held && r.held
	}
	if err := drv.StreamSynchronize(g.s); err != nil {
		return tm, 0, err
	}
	marks := make([]float64, count+1)
	for i, e := range evs {
		if marks[i], err = at(e); err != nil {
			return tm, 0, err
		}
	}
	var inside, overlap []float64
	for i := range count {
		d := marks[i+1] - marks[i]
		for _, w := range windows {
			if marks[i] >= w[0] && marks[i+1] <= w[1] {
				inside = append(inside, d)
				break
			}
			if marks[i+1] > w[0] && marks[i] < w[1] {
				overlap = append(overlap, d)
				break
			}
		}
	}
	if len(inside) == 0 {
		inside = overlap
	}
	if len(inside) > 0 {
		var sum float64
		for _, d := range inside {
			sum += d
		}
		slowPct = 100 * (sum/float64(len(inside))/soloMs - 1)
	}
	slices.Sort(times)
	slices.Sort(subs)
	tm.best, tm.median, tm.submit = times[0], times[len(times)/2], subs[len(subs)/2]
	return tm, slowPct, nil
}
