package offload

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
	"github.com/kvoffload/kvoffload/mmapmem"
)

// The tests of this file prove the growth pipeline's overlap by ordering:
// a stage waits, inside a hook, for an event only another stage can cause
// while the first is still in that step. A sequential growth would never
// cause it; the wait then gives up (liveness bound, not a timing
// assertion) and the test fails instead of hanging.

// growSlot is the slot size of the growth tests' layouts (8 KiB); their
// pools are 4 regions of 8 slots, without a staging region.
const growSlot = int64(8 << 10)

func growConfig(l LayoutSpec) Config {
	return Config{PoolBytes: 32 * growSlot, FirstRegionBytes: 8 * growSlot, RegionBytes: 8 * growSlot, StagingBytes: -1,
		Layout: l, Policy: PolicyLRU}
}

// marks are named one-shot events that hooks signal and wait for.
type marks struct {
	t   *testing.T
	mu  sync.Mutex
	chs map[string]chan struct{}
}

func newMarks(t *testing.T) *marks { return &marks{t: t, chs: map[string]chan struct{}{}} }

func (m *marks) ch(name string) chan struct{} {
	m.mu.Lock()
	defer m.mu.Unlock()
	c, ok := m.chs[name]
	if !ok {
		c = make(chan struct{})
		m.chs[name] = c
	}
	return c
}

// hit signals name (again: no effect).
func (m *marks) hit(name string) {
	c := m.ch(name)
	m.mu.Lock()
	defer m.mu.Unlock()
	select {
	case <-c:
	default:
		close(c)
	}
}

func (m *marks) seen(name string) bool {
	select {
	case <-m.ch(name):
		return true
	default:
		return false
	}
}

// wait blocks until name is signalled; after a minute it reports, as a
// test error, that it never was (the stage that should have run meanwhile
// did not) and returns false.
func (m *marks) wait(name, while string) bool {
	select {
	case <-m.ch(name):
		return true
	case <-time.After(time.Minute):
		m.t.Errorf("%s never happened while %s", name, while)
		return false
	}
}

// growRig is an engine whose background growth tests observe: every region
// the prefetch stage mapped is kept, to check it is unmapped in the end.
type growRig struct {
	t      *testing.T
	d      *cudafake.Driver
	g      *gpuMem
	e      *Engine
	mu     sync.Mutex
	mapped map[int]*mmapmem.Region
}

var stepNames = map[growStep]string{stepRegister: "register", stepPrefault: "prefault", stepPrefaulted: "prefaulted", stepCache: "cache"}

// newGrowRig starts an engine on backend (BackendHost or BackendCUDA over
// the fake driver) with h's hooks, wrapped to record the regions and to
// signal "<step> <i>" on m (step: register, prefault, prefaulted, cache)
// before h's hook runs. setup runs before New (rg.d is set on CUDA). The
// caller must call close (CUDA: on the test's goroutine, whose thread
// newGPUMem locks).
func newGrowRig(t *testing.T, backend Backend, m *marks, opts cudafake.Options, h engineHooks, setup func(*growRig)) (*growRig, error) {
	rg := &growRig{t: t, mapped: map[int]*mmapmem.Region{}}
	step, before := h.growStep, h.beforeGrow
	h.growStep = func(i int, s growStep, r *mmapmem.Region) error {
		rg.mu.Lock()
		rg.mapped[i] = r
		rg.mu.Unlock()
		m.hit(fmt.Sprint(stepNames[s], " ", i))
		if step != nil {
			return step(i, s, r)
		}
		return nil
	}
	h.beforeGrow = func(i int) {
		m.hit(fmt.Sprint("register ", i))
		if before != nil {
			before(i)
		}
	}
	var err error
	if backend == BackendHost {
		t.Cleanup(func() { goleak.VerifyNone(t) })
		if setup != nil {
			setup(rg)
		}
		cfg := growConfig(smallLayout(8))
		cfg.Backend, cfg.SkipMemoryCheck = BackendHost, true
		rg.e, err = newEngine(cfg, h)
		return rg, err
	}
	rg.d = fakeDriver(t, opts)
	rg.g = newGPUMem(t, rg.d, 8<<10)
	if setup != nil {
		setup(rg)
	}
	rg.e, err = newCUDAEngine(t, rg.d, growConfig(rg.g.layout(LayoutLayerSeparate, 16)), h)
	return rg, err
}

// close closes the engine (if not yet) and checks that every region the
// prefetch stage mapped is unmapped.
func (rg *growRig) close() {
	if rg.e != nil && !rg.e.closed.Load() {
		require.NoError(rg.t, rg.e.Close())
	}
	rg.mu.Lock()
	for i, r := range rg.mapped {
		require.Nil(rg.t, r.Bytes(), "region %d unmapped", i)
	}
	rg.mu.Unlock()
	if rg.g != nil {
		rg.g.close()
	}
}

// region returns the mapping of plan region i as the prefetch stage made it.
func (rg *growRig) region(i int) *mmapmem.Region {
	rg.mu.Lock()
	defer rg.mu.Unlock()
	return rg.mapped[i]
}

// TestGrowthPipelineOverlap: while region 1 registers (CUDA: inside
// cuMemHostRegister; host: between the growth thread taking region 1 and
// pinning it), region 2 is mapped and prefaulted whole; while region 1 is
// being added to the cache, region 2 registers. Prefetched regions are
// registered resident (not deferred: nothing prefaulted again); the first
// region, pinned by New, took the pipelined path.
func TestGrowthPipelineOverlap(t *testing.T) {
	for _, backend := range []Backend{BackendHost, BackendCUDA} {
		t.Run(string(backend), func(t *testing.T) {
			m := newMarks(t)
			// registering(i) runs while region i is being registered.
			registering := func(i int) {
				switch i {
				case 1:
					m.wait("prefaulted 2", "region 1 registered")
				case 2:
					m.hit("registering 2")
					m.wait("cache 1", "region 2 registered")
				}
			}
			h := engineHooks{growStep: func(i int, s growStep, _ *mmapmem.Region) error {
				if s == stepCache && i == 1 {
					m.wait("registering 2", "region 1 was added to the cache")
				}
				return nil
			}}
			if backend == BackendHost {
				h.beforeGrow = registering
			}
			rg, err := newGrowRig(t, backend, m, cudafake.Options{}, h, func(rg *growRig) {
				if rg.d == nil {
					return
				}
				// No staging region, one range per region: call n of
				// cuMemHostRegister registers region n-1.
				rg.d.SetHook(func(op string, call int) cuda.Result {
					if op == cuda.OpMemHostRegister {
						registering(call - 1)
					}
					return 0
				})
			})
			require.NoError(t, err)
			defer rg.close()
			require.NoError(t, rg.e.WaitGrown(context.Background()))
			st := rg.e.Stats()
			require.Equal(t, 4, st.Pool.Regions)
			require.Equal(t, 32*growSlot, st.Pool.OwnedBytes)
			require.Positive(t, st.Pool.FullPool)
			rg.e.memory.mu.Lock()
			defer rg.e.memory.mu.Unlock()
			for i, pr := range rg.e.memory.regions {
				if i > 0 {
					require.Same(t, rg.region(i), pr.r, "region %d came from the prefetch stage", i)
				}
				require.False(t, pr.r.Deferred(), "region %d is resident", i)
			}
		})
	}
}

// stagePoint is where a pause or Close test holds growth: hold is called
// by the hooks at every step and blocks at the chosen one until released.
type stagePoint struct {
	name string
	// at reports whether step s of region i (stepRegister: the growth
	// thread about to register region i) is the point.
	at func(i int, s growStep) bool
	// before are the marks the hook waits for at the point before
	// signalling "at", so that the other stages are where the test wants
	// them; with holdRegister1 the growth thread is also held before it
	// registers region 1, until release.
	before        []string
	holdRegister1 bool
	// paused is how many regions have joined once growth, paused at the
	// point and released, settles; held is the region then held mapped.
	paused, held int
}

const stepRegister growStep = -1

var stagePoints = []stagePoint{
	{"prefault", func(i int, s growStep) bool { return i == 2 && s == stepPrefault }, []string{"register 1"}, true, 2, 2},
	{"prefaulted", func(i int, s growStep) bool { return i == 2 && s == stepPrefaulted }, []string{"register 1"}, true, 2, 2},
	{"register", func(i int, s growStep) bool { return i == 2 && s == stepRegister }, []string{"prefault 3"}, false, 3, 3},
	{"cache", func(i int, s growStep) bool { return i == 1 && s == stepCache }, []string{"register 2", "prefault 3"}, false, 3, 3},
}

// holdAt returns hooks that stop growth at p until release is closed,
// signalling "at" on m once there and p.before were signalled (by
// newGrowRig's wrapper).
func holdAt(p stagePoint, m *marks, release <-chan struct{}) engineHooks {
	hold := func(i int, s growStep) {
		if p.holdRegister1 && s == stepRegister && i == 1 {
			<-release
			return
		}
		if !p.at(i, s) {
			return
		}
		for _, b := range p.before {
			m.wait(b, "growth was held at "+p.name)
		}
		m.hit("at")
		<-release
	}
	return engineHooks{
		beforeGrow: func(i int) { hold(i, stepRegister) },
		growStep: func(i int, s growStep, _ *mmapmem.Region) error {
			hold(i, s)
			return nil
		},
	}
}

// heldAt starts a growth rig on backend whose growth is held at p, and
// returns once it is there, with the marks and the channel whose close
// releases it; the caller closes the rig.
func heldAt(t *testing.T, backend Backend, p stagePoint) (*growRig, *marks, chan struct{}) {
	t.Helper()
	m := newMarks(t)
	release := make(chan struct{})
	rg, err := newGrowRig(t, backend, m, cudafake.Options{}, holdAt(p, m, release), nil)
	require.NoError(t, err)
	if !m.wait("at", "growth ran") {
		rg.close()
		t.FailNow()
	}
	return rg, m, release
}

// TestGrowthPauseAtEachStage pauses growth while it is held at each stage
// point: the regions in registration or publication join, the prefetched
// one is held mapped but not owned, nothing more is mapped until
// ResumeGrowth, which completes the pool. A second round closes while
// paused instead: the held region is unmapped.
func TestGrowthPauseAtEachStage(t *testing.T) {
	for _, backend := range []Backend{BackendHost, BackendCUDA} {
		for _, p := range stagePoints {
			for _, end := range []string{"resume", "close"} {
				t.Run(fmt.Sprintf("%s/%s/%s", backend, p.name, end), func(t *testing.T) {
					rg, m, release := heldAt(t, backend, p)
					defer rg.close()
					e := rg.e
					e.PauseGrowth()
					close(release)
					ok := assert.Eventually(t, func() bool {
						return e.Stats().Pool.Regions == p.paused && m.seen(fmt.Sprint("prefaulted ", p.held))
					}, 20*time.Second, time.Millisecond, "growth settles while paused")
					require.True(t, ok, "regions %d, seen %v", e.Stats().Pool.Regions, m.seen(fmt.Sprint("prefaulted ", p.held)))
					st := e.Stats()
					require.True(t, st.Pool.GrowthPaused)
					require.Equal(t, p.paused, st.Pool.Regions)
					require.Equal(t, int64(p.paused)*8*growSlot, st.Pool.OwnedBytes, "the held region is not owned")
					require.Equal(t, int64(p.paused)*8, st.Pool.SlotsTotal)
					require.Zero(t, st.Pool.FullPool)
					require.NotNil(t, rg.region(p.held).Bytes(), "region %d is held mapped", p.held)
					require.Nil(t, rg.region(p.held+1), "nothing is mapped after the held region while paused")
					if end == "close" {
						require.NoError(t, e.Close())
						require.ErrorIs(t, e.WaitGrown(context.Background()), ErrClosed)
						return
					}
					e.ResumeGrowth()
					require.NoError(t, e.WaitGrown(context.Background()))
					st = e.Stats()
					require.Equal(t, 4, st.Pool.Regions)
					require.Equal(t, 32*growSlot, st.Pool.OwnedBytes)
					require.Positive(t, st.Pool.FullPool)
				})
			}
		}
	}
}

// TestGrowthCloseAtEachStage closes the engine while growth is held at each
// stage point: Close waits for the stage, growth stops, every region the
// pipeline had mapped is unmapped (and, on CUDA, unregistered: fakeDriver
// checks), no goroutine is left.
func TestGrowthCloseAtEachStage(t *testing.T) {
	for _, backend := range []Backend{BackendHost, BackendCUDA} {
		for _, p := range stagePoints {
			t.Run(string(backend)+"/"+p.name, func(t *testing.T) {
				rg, _, release := heldAt(t, backend, p)
				defer rg.close()
				e := rg.e
				closed := make(chan error, 1)
				go func() { closed <- e.Close() }()
				require.Eventually(t, func() bool {
					e.growth.mu.Lock()
					defer e.growth.mu.Unlock()
					return e.growth.stop
				}, time.Minute, time.Millisecond, "Close stops growth")
				close(release)
				require.NoError(t, <-closed)
				require.ErrorIs(t, e.WaitGrown(context.Background()), ErrClosed)
				require.Zero(t, e.Stats().Pool.OwnedBytes)
			})
		}
	}
}

var errInjected = errors.New("injected failure")

// calibrationOptions keep the background calibration small.
func calibrationOptions() cudacopy.Options {
	return cudacopy.Options{Calibrate: cudacopy.CalibrationConfig{TotalBytes: 1 << 20, SegSizes: []uint64{16 << 10}, Pieces: 1, Reps: 1}}
}

// TestGrowthFailureAtEachStage fails region 2 in each stage: its prefault,
// its registration, its host ranges (the copier's device-pointer lookup),
// its addition to the cache. Growth stops with that error; regions 0 and 1
// joined, region 2 and anything after it were released (unregistered and
// unmapped), and the engine serves from what it has.
func TestGrowthFailureAtEachStage(t *testing.T) {
	cases := []struct {
		name     string
		backends []Backend
		opts     cudafake.Options
		step     growStep // the hook fails region 2 at this step (stepRegister: none)
		fail     func(d *cudafake.Driver)
		want     string
	}{
		{"prefault", []Backend{BackendHost, BackendCUDA}, cudafake.Options{}, stepPrefault, nil, "prefaulting pool region 2"},
		{"prefaulted", []Backend{BackendHost}, cudafake.Options{}, stepPrefaulted, nil, "prefaulting pool region 2"},
		// No staging region, one range per region: call 3 is region 2.
		{"register", []Backend{BackendCUDA}, cudafake.Options{}, stepRegister, func(d *cudafake.Driver) {
			d.FailAt(cuda.OpMemHostRegister, 3, cuda.ErrorOutOfMemory)
		}, "CUDA_ERROR_OUT_OF_MEMORY"},
		{"host ranges", []Backend{BackendCUDA}, cudafake.Options{Attributes: map[cuda.Attribute]int{cuda.AttrCanUseHostPointerForRegisteredMem: 0}},
			stepRegister, func(d *cudafake.Driver) {
				d.FailAt(cuda.OpMemHostGetDevicePointer, 3, cuda.ErrorInvalidValue)
			}, "host ranges of a region"},
		{"cache", []Backend{BackendHost, BackendCUDA}, cudafake.Options{}, stepCache, nil, "adding pool region 2 to the cache"},
	}
	for _, c := range cases {
		for _, backend := range c.backends {
			t.Run(c.name+"/"+string(backend), func(t *testing.T) {
				m := newMarks(t)
				h := engineHooks{growStep: func(i int, s growStep, _ *mmapmem.Region) error {
					if i == 2 && s == c.step {
						return errInjected
					}
					return nil
				}}
				rg, err := newGrowRig(t, backend, m, c.opts, h, func(rg *growRig) {
					if c.fail != nil {
						c.fail(rg.d)
					}
				})
				require.NoError(t, err)
				defer rg.close()
				e := rg.e
				err = e.WaitGrown(context.Background())
				require.ErrorContains(t, err, c.want)
				require.ErrorContains(t, err, "background growth stopped")
				if c.fail == nil {
					require.ErrorIs(t, err, errInjected)
				}
				st := e.Stats()
				require.Equal(t, 2, st.Pool.Regions)
				require.Equal(t, 16*growSlot, st.Pool.OwnedBytes)
				require.Equal(t, int64(16), st.Pool.SlotsTotal)
				require.Contains(t, st.Pool.GrowthError, c.want)
				require.Zero(t, st.Pool.FullPool)
				require.Nil(t, rg.region(2).Bytes(), "the failed region is unmapped")
				if r := rg.region(3); r != nil {
					require.Nil(t, r.Bytes(), "the region after it is unmapped")
				}
				require.Equal(t, int64(2), st.Pool.PinCalls-st.Pool.UnpinCalls, "pinned now: the two regions that joined")
				if rg.d != nil {
					require.Equal(t, 2, rg.d.Live().Registrations, "only the regions that joined stay registered")
					storeOverwriteLoad(t, e, rg.g, 4, 61)
				}
			})
		}
	}
}

// TestGrowthCalibration: the copy methods are calibrated after the whole
// pool has joined (Stats.Pool.FullPool stamped) and before WaitGrown returns;
// when growth is paused first, they are calibrated during the pause, once.
func TestGrowthCalibration(t *testing.T) {
	for _, pause := range []bool{false, true} {
		t.Run(fmt.Sprint("paused=", pause), func(t *testing.T) {
			m := newMarks(t)
			var mu sync.Mutex
			var eng *Engine
			var fullAtCalibration []time.Duration
			var regionsAtCalibration []int
			h := engineHooks{calibrate: true, copyOptions: calibrationOptions(), beforeGrow: func(i int) {
				if i == 1 {
					m.wait("started", "New returned")
				}
			}}
			rg, err := newGrowRig(t, BackendCUDA, m, cudafake.Options{}, h, func(rg *growRig) {
				rg.d.SetHook(func(op string, _ int) cuda.Result {
					mu.Lock()
					defer mu.Unlock()
					if op == cuda.OpStreamCreate && eng != nil {
						// The calibration's stream: nothing else creates one after New.
						eng.memory.mu.Lock()
						regionsAtCalibration = append(regionsAtCalibration, len(eng.memory.regions))
						eng.memory.mu.Unlock()
						fullAtCalibration = append(fullAtCalibration, time.Duration(eng.stats.fullPool.Load()))
					}
					return 0
				})
			})
			require.NoError(t, err)
			defer rg.close()
			e := rg.e
			require.Empty(t, e.Stats().Copies.Calibration, "not calibrated when New returns")
			mu.Lock()
			eng = e
			mu.Unlock()
			if pause {
				e.PauseGrowth()
			}
			m.hit("started")
			if pause {
				require.Eventually(t, func() bool { return e.Stats().Copies.Calibration != "" }, time.Minute, time.Millisecond)
				require.Less(t, e.Stats().Pool.Regions, 4)
				e.ResumeGrowth()
			}
			require.NoError(t, e.WaitGrown(context.Background()))
			st := e.Stats()
			require.Contains(t, st.Copies.Calibration, "calibrated in")
			mu.Lock()
			defer mu.Unlock()
			require.Len(t, fullAtCalibration, 1, "calibrated once")
			if pause {
				require.Less(t, regionsAtCalibration[0], 4)
			} else {
				require.Equal(t, 4, regionsAtCalibration[0])
				require.Positive(t, fullAtCalibration[0], "calibrated after the pool was full")
			}
		})
	}
}

// A PauseGrowth that comes once the last region is on its way does not hold
// WaitGrown: nothing is left to pause.
func TestGrowthPausedAfterLastRegion(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	engine := make(chan *Engine, 1)
	h := engineHooks{beforeGrow: func(i int) {
		if i == 3 {
			(<-engine).PauseGrowth()
		}
	}}
	e, err := newEngine(growConfig(smallLayout(8)), h)
	require.NoError(t, err)
	engine <- e
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, e.WaitGrown(ctx), "WaitGrown held by a pause with nothing left to grow")
	require.Equal(t, 4, e.Stats().Pool.Regions)
	require.NoError(t, e.Close())
}
