package transfer_test

import (
	"bytes"
	"errors"
	"math/rand"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
	. "github.com/kvoffload/kvoffload/transfer"
)

// countingBuild wraps a lazy request's Build: it counts calls, records
// whether two ran at once or out of order, and fails part fail (-1: none).
type countingBuild struct {
	calls   atomic.Int32
	running atomic.Int32
	overlap atomic.Bool
	mu      sync.Mutex
	parts   []int
}

func (c *countingBuild) wrap(build func(int, []Segment) ([]Segment, error), fail int, boom error) func(int, []Segment) ([]Segment, error) {
	return func(p int, dst []Segment) ([]Segment, error) {
		if c.running.Add(1) > 1 {
			c.overlap.Store(true)
		}
		defer c.running.Add(-1)
		c.calls.Add(1)
		c.mu.Lock()
		c.parts = append(c.parts, p)
		c.mu.Unlock()
		time.Sleep(time.Millisecond) // give the other goroutine time to overlap, were it to
		if p == fail {
			return dst, boom
		}
		return build(p, dst)
	}
}

// TestPipelinedParts: an op of many parts (built one part ahead of the
// copies on a builder goroutine) copies every byte, calls Build once per
// part, in order, never two at once.
func TestPipelinedParts(t *testing.T) {
	const seg, n = 4096, 16 * 4096
	e := newFakeEnv(t, 2*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 21})
	loadAllParts(t, e, n, seg, false, 22)
}

// loadAllParts loads n random bytes (seeded) as a lazy op of seg-byte
// parts (per layer when layered) and checks every byte arrived and Build
// was called once per part, in order, never two at once.
func loadAllParts(t *testing.T, e *fakeEnv, n, seg uint64, layered bool, seed int64) {
	t.Helper()
	src := randBytes(rand.New(rand.NewSource(seed)), n)
	copy(e.hostBuf, src)
	var c countingBuild
	req := lazyLoad(e, n, seg, layered, -1, nil)
	req.Build = c.wrap(req.Build, -1, nil)
	op, err := submitWithin(t, e.s, req, 5*time.Second)
	require.NoError(t, err)
	require.NoError(t, op.Wait())
	require.Equal(t, src, e.deviceBytes(t, n))
	require.False(t, c.overlap.Load(), "two Build calls at once")
	want := make([]int, n/seg)
	for i := range want {
		want[i] = i
	}
	require.Equal(t, want, c.parts)
}

// TestPipelinedSteal: with several builders, a part no builder has
// started when the submitting thread needs it is built by that thread
// (builders held back as a slow wake holds them: every part; builders
// late by a few parts, let go once the submitting thread has built three:
// some), each part exactly once, every byte copied.
func TestPipelinedSteal(t *testing.T) {
	const seg, n = 4096, 32 * 4096
	for _, tc := range []struct {
		name  string
		delay time.Duration
		all   bool // every part built on the submitting thread
	}{
		{"held", time.Hour, true},
		{"late", 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var onSubmitter atomic.Int32
			// late: the builders start once the submitting thread has built
			// three parts (a fixed delay let a descheduled submitting
			// thread fall behind them under -race on two cores).
			gate := make(chan struct{})
			var open sync.Once
			e := newFakeEnvConfig(t, 2*n, cudacopy.Options{Method: cudacopy.MethodMemcpy}, cudafake.Options{Seed: 31},
				Config{Builders: 4, Trace: func(point string, _ int) {
					if point == "built" && onSubmitter.Add(1) >= 3 && !tc.all {
						open.Do(func() { close(gate) })
					}
				}})
			if tc.all {
				e.s.SetBuilderHooks(tc.delay, nil)
			} else {
				e.s.SetBuilderHooks(tc.delay, gate)
			}
			src := randBytes(rand.New(rand.NewSource(32)), n)
			copy(e.hostBuf, src)
			var c countingBuild
			req := lazyLoad(e, n, seg, false, -1, nil)
			slow := req.Build
			req.Build = c.wrap(func(p int, dst []Segment) ([]Segment, error) {
				time.Sleep(200 * time.Microsecond) // the builders' share, were they awake
				return slow(p, dst)
			}, -1, nil)
			op, err := submitWithin(t, e.s, req, 5*time.Second)
			require.NoError(t, err)
			waitWithin(t, op, 5*time.Second)
			require.NoError(t, op.Release())
			require.Equal(t, src, e.deviceBytes(t, n))
			parts := slices.Clone(c.parts)
			slices.Sort(parts)
			want := make([]int, n/seg)
			for i := range want {
				want[i] = i
			}
			require.Equal(t, want, parts, "each part built exactly once")
			if tc.all {
				require.EqualValues(t, n/seg, onSubmitter.Load(), "every part built on the submitting thread")
				require.Equal(t, want, c.parts, "in order")
			} else {
				require.Greater(t, onSubmitter.Load(), int32(1), "parts beyond the first built on the submitting thread")
			}
		})
	}
}

// TestPipelinedFailure: a part that fails to build, or a copy that fails
// part-way, fails the op; the builder stops (nothing built after a failed
// part, at most one part ahead of a failed copy), nothing is built once
// the op has completed, and the engine goes on.
func TestPipelinedFailure(t *testing.T) {
	const seg, n = 4096, 16 * 4096
	boom := errors.New("boom")
	for _, tc := range []struct {
		name      string
		buildFail int   // part whose Build fails (-1: none)
		copyFail  int   // the copy (memcpy) that fails, counting from 1 (0: none)
		maxCalls  int32 // Build calls at most
		exact     bool  // and exactly
	}{
		{"build", 5, 0, 6, true},  // parts 0..5 built, none after the failed one
		{"copy", -1, 4, 5, false}, // parts 0..3 built and copied, part 4 at most
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newFakeEnv(t, 2*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 23})
			var c countingBuild
			req := lazyLoad(e, n, seg, false, -1, nil)
			req.Build = c.wrap(req.Build, tc.buildFail, boom)
			if tc.copyFail > 0 {
				e.drv.FailAt(cuda.OpMemcpyAsync, e.drv.Calls(cuda.OpMemcpyAsync)+tc.copyFail, cuda.ErrorInvalidValue)
			}
			op, err := submitWithin(t, e.s, req, 5*time.Second)
			require.NoError(t, err)
			if err := op.Wait(); tc.buildFail >= 0 {
				require.ErrorIs(t, err, boom)
			} else {
				require.Error(t, err)
			}
			calls := c.calls.Load()
			require.LessOrEqual(t, calls, tc.maxCalls, "built past the failure")
			if tc.exact {
				require.Equal(t, tc.maxCalls, calls)
			}
			time.Sleep(20 * time.Millisecond)
			require.Equal(t, calls, c.calls.Load(), "Build called after the op completed")
			op2, err := submitWithin(t, e.s, lazyLoad(e, n, seg, false, -1, nil), 5*time.Second)
			require.NoError(t, err)
			require.NoError(t, op2.Wait())
		})
	}
}

// TestPipelinedLayers: a per-layer op's layers are built one ahead of
// their copies by its feed: every byte copied, each layer built once, in
// order, never two at once; a layer that fails to build fails the op and
// nothing is built after it, nor once the op has completed.
func TestPipelinedLayers(t *testing.T) {
	const seg, n = 4096, 12 * 4096
	e := newFakeEnv(t, 2*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 25})
	loadAllParts(t, e, n, seg, true, 26)

	boom := errors.New("boom")
	var f countingBuild
	bad := lazyLoad(e, n, seg, true, -1, nil)
	bad.Build = f.wrap(bad.Build, 4, boom)
	op, err := submitWithin(t, e.s, bad, 5*time.Second)
	require.NoError(t, err)
	require.ErrorIs(t, op.Wait(), boom)
	calls := f.calls.Load()
	require.Equal(t, int32(5), calls, "layers 0..4 built, none after the failed one")
	time.Sleep(20 * time.Millisecond)
	require.Equal(t, calls, f.calls.Load(), "Build called after the op completed")
}

// TestPipelinedSharedBatch: many lazy per-layer ops issued in one batch
// share the issue's one builder: every byte copied, each op's layers built
// once and in order, never two Build calls at once.
func TestPipelinedSharedBatch(t *testing.T) {
	const seg, n, ops = 4096, 6 * 4096, 8
	e := newFakeEnv(t, 2*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 27})
	src := randBytes(rand.New(rand.NewSource(28)), n)
	copy(e.hostBuf, src)
	hold := make(chan struct{})
	busy := busyLoad(t, e, n, seg, hold)
	var running, calls atomic.Int32
	var overlap atomic.Bool
	parts := make([][]int, ops)
	var all []*Op
	for i := range ops {
		req := lazyLoad(e, n, seg, true, -1, nil)
		req.Events = false // queued, and issued with the others in one batch
		build := req.Build
		req.Build = func(p int, dst []Segment) ([]Segment, error) {
			if running.Add(1) > 1 {
				overlap.Store(true)
			}
			defer running.Add(-1)
			calls.Add(1)
			parts[i] = append(parts[i], p)
			return build(p, dst)
		}
		op, err := submitWithin(t, e.s, req, 5*time.Second)
		require.NoError(t, err)
		all = append(all, op)
	}
	close(hold)
	require.NoError(t, busy.Wait())
	for _, op := range all {
		require.NoError(t, op.Wait())
	}
	require.Equal(t, src, e.deviceBytes(t, n))
	require.False(t, overlap.Load(), "two Build calls at once")
	require.Equal(t, int32(ops*n/seg), calls.Load())
	for i := range ops {
		require.Equal(t, []int{0, 1, 2, 3, 4, 5}, parts[i], "op %d", i)
	}
}

// stridedLazy is a lazy request of n bytes of host memory in parts of seg
// bytes, each part one 2-D segment of rows of row bytes: back to back on
// the host at e.host+hostOff, at twice the row's pitch on the device (the
// device span of part p starts at 2·p·seg), and build wrapped by c.
func stridedLazy(e *fakeEnv, dir Direction, n, seg, row, hostOff uint64, c *countingBuild, fail int, boom error) Request {
	rows := seg / row
	req := Request{Dir: dir, Parts: int(n / seg), Bytes: n}
	req.Build = c.wrap(func(p int, dst []Segment) ([]Segment, error) {
		off := uint64(p) * seg
		return append(dst, Segment{Dev: e.dev + 2*off, Host: e.host + hostOff + off, Len: seg,
			Rows: rows, RowLen: row, DevPitch: 2 * row, HostPitch: row}), nil
	}, fail, boom)
	return req
}

// TestParallelBuilders: with three builders a lazy op's parts are built at
// once, out of order, each once, and copied in order: a strided load into
// a poisoned device and a store back copy every byte and leave every gap
// poisoned, for each copy method forced; the copies were prepared on the
// builders (CUDA.Prepare), the submitting thread only enqueuing them.
func TestParallelBuilders(t *testing.T) {
	const seg, row, n = 4096, 128, 24 * 4096
	for _, m := range []cudacopy.Method{cudacopy.MethodMemcpy, cudacopy.MethodBatch, cudacopy.MethodKernel} {
		t.Run(m.String(), func(t *testing.T) {
			e := newFakeEnvBuilders(t, 4*n, cudacopy.Options{Method: m}, cudafake.Options{Seed: 29, MaxDelay: 20 * time.Microsecond}, 3)
			src := randBytes(rand.New(rand.NewSource(30)), n)
			copy(e.hostBuf, src)
			for i := range e.hostBuf[n:] {
				e.hostBuf[n+i] = 0xEE
			}
			require.NoError(t, e.drv.MemsetD8(cuda.DevicePtr(e.dev), 0xDD, 2*n))
			var lc, sc countingBuild
			op, err := submitWithin(t, e.s, stridedLazy(e, Load, n, seg, row, 0, &lc, -1, nil), 5*time.Second)
			require.NoError(t, err)
			require.NoError(t, op.Wait())
			dev := e.deviceBytes(t, 2*n)
			for r := uint64(0); r < n/row; r++ {
				require.Equal(t, src[r*row:(r+1)*row], dev[2*r*row:(2*r+1)*row], "row %d", r)
				require.Equal(t, bytes.Repeat([]byte{0xDD}, row), dev[(2*r+1)*row:(2*r+2)*row], "gap after row %d", r)
			}
			op, err = submitWithin(t, e.s, stridedLazy(e, Store, n, seg, row, n, &sc, -1, nil), 5*time.Second)
			require.NoError(t, err)
			require.NoError(t, op.Wait())
			require.Equal(t, src, e.hostBuf[n:2*n])
			for _, c := range []*countingBuild{&lc, &sc} {
				require.True(t, c.overlap.Load(), "three builders never built two parts at once")
				got := slices.Clone(c.parts)
				slices.Sort(got)
				require.Len(t, got, n/seg)
				for i, p := range got {
					require.Equal(t, i, p, "each part built once")
				}
			}
			require.Equal(t, int64(2*n/seg), e.cu.PreparedCopies(), "every part's copy prepared on a builder")
		})
	}
}

// TestParallelBuildersFailure: with three builders a part that fails to
// build fails the op with its error, no builder builds more than two parts
// ahead of it nor anything once the op has completed; a copy that fails to
// prepare (a misaligned row with the kernel forced) is copied unprepared
// and fails with the copy's error; the engine goes on.
func TestParallelBuildersFailure(t *testing.T) {
	const seg, row, n = 4096, 128, 24 * 4096
	boom := errors.New("boom")
	e := newFakeEnvBuilders(t, 2*n, cudacopy.Options{Method: cudacopy.MethodKernel}, cudafake.Options{Seed: 31}, 3)
	var c countingBuild
	op, err := submitWithin(t, e.s, stridedLazy(e, Load, n, seg, row, 0, &c, 5, boom), 5*time.Second)
	require.NoError(t, err)
	require.ErrorIs(t, op.Wait(), boom)
	calls := c.calls.Load()
	require.LessOrEqual(t, calls, int32(5+1+2*3), "built far past the failed part")
	time.Sleep(20 * time.Millisecond)
	require.Equal(t, calls, c.calls.Load(), "Build called after the op completed")

	var mis countingBuild
	bad := stridedLazy(e, Load, n, seg, row, 0, &mis, -1, nil)
	build := bad.Build
	bad.Build = func(p int, dst []Segment) ([]Segment, error) {
		dst, err := build(p, dst)
		if p == 7 {
			dst[len(dst)-1].RowLen, dst[len(dst)-1].Len = row-8, (row-8)*(seg/row) // 8-byte rows: the kernel needs 16
		}
		return dst, err
	}
	bad.Bytes = n - 8*(seg/row)
	op, err = submitWithin(t, e.s, bad, 5*time.Second)
	require.NoError(t, err)
	require.ErrorIs(t, op.Wait(), cudacopy.ErrMisaligned)

	var ok countingBuild
	op, err = submitWithin(t, e.s, stridedLazy(e, Load, n, seg, row, 0, &ok, -1, nil), 5*time.Second)
	require.NoError(t, err)
	require.NoError(t, op.Wait())
}

// TestBuildersAcrossIssues: issues of different part counts one after the
// other, with four builders, so that each uses another number of them (a
// feed that grew its builders for one issue reuses them for the next):
// every op completes and copies every byte. It hung when a feed reused a
// builder it had never set up.
func TestBuildersAcrossIssues(t *testing.T) {
	const seg = 4096
	e := newFakeEnvBuilders(t, 2*16*seg, cudacopy.Options{Method: cudacopy.MethodMemcpy}, cudafake.Options{Seed: 33}, 4)
	src := randBytes(rand.New(rand.NewSource(34)), 16*seg)
	copy(e.hostBuf, src)
	for _, parts := range []int{2, 3, 5, 2, 4, 1, 6, 3, 4, 2, 7} {
		n := uint64(parts) * seg
		req := lazyLoad(e, n, seg, false, -1, nil)
		req.Events = false
		op, err := submitWithin(t, e.s, req, 5*time.Second)
		require.NoError(t, err)
		done := make(chan error, 1)
		go func() { done <- op.Wait() }()
		select {
		case err := <-done:
			require.NoError(t, err, "%d parts", parts)
		case <-time.After(10 * time.Second):
			t.Fatalf("an op of %d parts did not complete", parts)
		}
		require.Equal(t, src[:n], e.deviceBytes(t, n), "%d parts", parts)
	}
}
