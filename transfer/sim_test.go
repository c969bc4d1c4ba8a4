package transfer_test

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/cuda"
	. "github.com/kvoffload/kvoffload/internal/cudadev"
	. "github.com/kvoffload/kvoffload/transfer"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// simEnv is a Sim with one device allocation and one host buffer, known to
// a Scheduler.
type simEnv struct {
	sim        *Sim
	s          *Scheduler
	dev, host  uint64
	size       uint64
	hostBuf    []byte
	tracker    *Tracker
	callerStrm Stream
}

func newSimEnv(t *testing.T, size uint64, cfg Config, sc SimConfig) *simEnv {
	t.Helper()
	return newSimEnvOn(t, size, cfg, sc, nil)
}

// newSimEnvOn is newSimEnv with the scheduler on wrap(sim) (nil: the sim).
func newSimEnvOn(t *testing.T, size uint64, cfg Config, sc SimConfig, wrap func(*Sim) Device) *simEnv {
	t.Helper()
	sim, err := NewSim(sc)
	require.NoError(t, err)
	dev, err := sim.MemAlloc(size)
	require.NoError(t, err)
	hb, err := unix.Mmap(-1, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	require.NoError(t, err)
	host, err := sim.RegisterHost(hb)
	require.NoError(t, err)
	e := &simEnv{sim: sim, dev: dev, host: host, size: size, hostBuf: hb}
	if cfg.Tracker == nil {
		// The default owner holds the whole host buffer live.
		e.tracker = NewTracker(func(addr, n uint64) { _ = sim.Fill(addr, n, PoisonByte) })
		require.NoError(t, e.tracker.Live(host, size))
		cfg.Tracker = e.tracker
	} else {
		e.tracker = cfg.Tracker
	}
	var d Device = sim
	if wrap != nil {
		d = wrap(sim)
	}
	s, err := New(d, cfg)
	require.NoError(t, err)
	require.NoError(t, s.AddDeviceRange(dev, size))
	require.NoError(t, s.AddHostRange(host, size))
	e.s = s
	e.callerStrm = sim.NewStream()
	t.Cleanup(func() {
		require.NoError(t, s.Close())
		require.NoError(t, sim.Close())
		require.NoError(t, unix.Munmap(hb))
		if InvariantsEnabled() {
			require.Empty(t, e.tracker.Violations())
		}
	})
	return e
}

func randBytes(r *rand.Rand, n uint64) []byte {
	b := make([]byte, n)
	r.Read(b)
	return b
}

// pendingEvent returns a caller event recorded behind a closed gate on the
// caller stream, and the func that opens the gate.
func (e *simEnv) pendingEvent(t *testing.T) (Event, func()) {
	t.Helper()
	open, err := e.sim.Gate(e.callerStrm)
	require.NoError(t, err)
	ev, err := e.sim.CreateEvent(false)
	require.NoError(t, err)
	require.NoError(t, e.sim.RecordEvent(ev, e.callerStrm))
	t.Cleanup(open)
	return ev, open
}

// TestRoundTripRandom stores random device bytes to random host slots from
// many goroutines, loads them back to other device blocks, and checks
// every byte.
func TestRoundTripRandom(t *testing.T) {
	const block, blocks = 4096, 256
	// Device: [0, half) sources, [half, size) load targets; host: slots.
	size := uint64(2 * block * blocks)
	e := newSimEnv(t, size, Config{MaxInFlightBytes: 64 << 10, MaxBatchesInFlight: 2, MaxQueuedBytes: 1 << 30},
		SimConfig{Seed: 1, MaxDelay: 200 * time.Microsecond})
	r := rand.New(rand.NewSource(2))
	src := randBytes(r, size/2)
	require.NoError(t, e.sim.Write(e.dev, src))
	perm := r.Perm(blocks)

	const workers = 8
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < blocks; i += workers * 2 {
				// Two blocks per op, one segment each, each half the block
				// so that coalescing joins them.
				var st []Segment
				for _, b := range []int{i, i + workers} {
					if b >= blocks {
						continue
					}
					slot := uint64(perm[b]) * block
					for h := uint64(0); h < block; h += block / 2 {
						st = append(st, Segment{Dev: e.dev + uint64(b)*block + h, Host: e.host + slot + h, Len: block / 2})
					}
				}
				op, err := submitRetry(e.s, Request{Dir: Store, Segments: st})
				if err == nil {
					err = op.Wait()
				}
				if err != nil {
					errs <- err
					return
				}
				ld := make([]Segment, len(st))
				for k, g := range st {
					ld[k] = Segment{Dev: g.Dev + size/2, Host: g.Host, Len: g.Len}
				}
				op, err = submitRetry(e.s, Request{Dir: Load, Segments: ld})
				if err == nil {
					err = op.Wait()
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	got := make([]byte, size/2)
	require.NoError(t, e.sim.Read(e.dev+size/2, got))
	require.True(t, bytes.Equal(src, got), "loaded bytes differ from stored ones")
	for b := range blocks {
		slot := uint64(perm[b]) * block
		require.Equal(t, src[b*block:(b+1)*block], e.hostBuf[slot:slot+block], "host slot of block %d", b)
	}
}

// submitRetry retries ErrBusy (the caller's choice; Submit never blocks).
func submitRetry(s *Scheduler, req Request) (*Op, error) {
	for {
		op, err := s.Submit(req)
		if !errors.Is(err, ErrBusy) {
			return op, err
		}
		time.Sleep(50 * time.Microsecond)
	}
}

func TestSubmitValidation(t *testing.T) {
	e := newSimEnv(t, 1<<20, Config{Align: 16}, SimConfig{})
	captured := e.sim.NewStream()
	require.NoError(t, e.sim.SetCapturing(captured, true))
	ev, err := e.sim.CreateEvent(false)
	require.NoError(t, err)
	good := Segment{Dev: e.dev, Host: e.host, Len: 4096}
	tests := []struct {
		name string
		req  Request
		want error
	}{
		{"no segments", Request{Dir: Store}, ErrInvalidRequest},
		{"bad direction", Request{Dir: 7, Segments: []Segment{good}}, ErrInvalidRequest},
		{"zero length", Request{Dir: Store, Segments: []Segment{{Dev: e.dev, Host: e.host}}}, ErrInvalidSegment},
		{"misaligned dev", Request{Dir: Store, Segments: []Segment{{Dev: e.dev + 8, Host: e.host, Len: 16}}}, ErrInvalidSegment},
		{"misaligned len", Request{Dir: Load, Segments: []Segment{{Dev: e.dev, Host: e.host, Len: 20}}}, ErrInvalidSegment},
		{"host past the range", Request{Dir: Store, Segments: []Segment{{Dev: e.dev, Host: e.host + e.size - 16, Len: 32}}}, ErrOutOfRange},
		{"host before the range", Request{Dir: Store, Segments: []Segment{{Dev: e.dev, Host: e.host - 16, Len: 16}}}, ErrOutOfRange},
		{"device past the allocation", Request{Dir: Load, Segments: []Segment{{Dev: e.dev + e.size, Host: e.host, Len: 16}}}, ErrOutOfRange},
		{"wraps", Request{Dir: Load, Segments: []Segment{{Dev: ^uint64(0) - 15, Host: e.host, Len: 32}}}, ErrInvalidSegment},
		{"layer ends short", Request{Dir: Load, Segments: []Segment{good, good}, LayerEnds: []int{1}}, ErrInvalidRequest},
		{"layer ends not increasing", Request{Dir: Load, Segments: []Segment{good, good}, LayerEnds: []int{1, 1, 2}}, ErrInvalidRequest},
		{"stream without event", Request{Dir: Store, Segments: []Segment{good}, AfterStream: &captured}, ErrInvalidRequest},
		{"capturing After stream", Request{Dir: Store, Segments: []Segment{good}, After: ev, AfterStream: &captured}, ErrCapturing},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			op, err := e.s.Submit(tc.req)
			require.ErrorIs(t, err, tc.want)
			require.Nil(t, op)
		})
	}
}

// TestBusyBounds holds the store stream behind a pending caller event and
// fills the in-flight bound, then the queue, then expects ErrBusy.
func TestBusyBounds(t *testing.T) {
	const seg = 4096
	e := newSimEnv(t, 1<<20, Config{MaxInFlightBytes: 4 * seg, MaxQueuedBytes: 3 * seg, MaxBatchesInFlight: 1}, SimConfig{Seed: 3})
	ev, open := e.pendingEvent(t)
	req := func(i int, after Event) Request {
		return Request{Dir: Store, After: after, Segments: []Segment{{Dev: e.dev + uint64(i)*seg, Host: e.host + uint64(i)*seg, Len: seg}}}
	}
	var ops []*Op
	first, err := e.s.Submit(req(0, ev))
	require.NoError(t, err)
	ops = append(ops, first)
	// The first batch is issued and waits on the gate; MaxBatchesInFlight=1
	// keeps everything else queued: three fit the queue, the fourth is busy.
	require.Eventually(t, func() bool {
		batches, _, _ := e.s.Counts(Store)
		return batches == 1
	}, 5*time.Second, time.Millisecond)
	for i := 1; i <= 3; i++ {
		op, err := e.s.Submit(req(i, 0))
		require.NoError(t, err, "request %d fits the queue", i)
		ops = append(ops, op)
	}
	_, err = e.s.Submit(req(4, 0))
	require.ErrorIs(t, err, ErrBusy)
	// Loads are independent of the store direction's bounds.
	ld, err := e.s.Submit(Request{Dir: Load, Segments: []Segment{{Dev: e.dev + 10*seg, Host: e.host + 10*seg, Len: seg}}})
	require.NoError(t, err)
	require.NoError(t, ld.Wait())
	// An events op is issued at once, never refused, with the in-flight
	// bound full and the queue full: its stream is its queue (a swap or an
	// eviction must not lose its blocks).
	evop, err := e.s.Submit(Request{Dir: Store, Events: true, Segments: []Segment{{Dev: e.dev + 12*seg, Host: e.host + 12*seg, Len: seg}}})
	require.NoError(t, err, "an events op over the in-flight bound")
	ops = append(ops, evop)
	open()
	for _, op := range ops {
		require.NoError(t, op.Wait())
	}
	_, inflight, queued := e.s.Counts(Store)
	require.Zero(t, inflight)
	require.Zero(t, queued)
}

func TestCopyFailureFailsOnlyItsBatch(t *testing.T) {
	e := newSimEnv(t, 1<<20, Config{}, SimConfig{Seed: 4})
	bad := &cuda.Error{Op: cuda.OpMemcpyAsync, Code: cuda.ErrorInvalidValue, Name: "CUDA_ERROR_INVALID_VALUE", Text: "invalid argument"}
	e.sim.FailNextCopy(bad)
	var cbErr error
	cbDone := make(chan struct{})
	op, err := e.s.Submit(Request{Dir: Store, Segments: []Segment{{Dev: e.dev, Host: e.host, Len: 64}},
		OnComplete: func(_ *Op, err error) { cbErr = err; close(cbDone) }})
	require.NoError(t, err)
	require.ErrorIs(t, op.Wait(), bad)
	<-cbDone
	require.ErrorIs(t, cbErr, bad)
	op2, err := e.s.Submit(Request{Dir: Store, Segments: []Segment{{Dev: e.dev, Host: e.host, Len: 64}}})
	require.NoError(t, err)
	require.NoError(t, op2.Wait())
}

func TestStickyErrorStopsNewWork(t *testing.T) {
	e := newSimEnv(t, 1<<20, Config{MaxBatchesInFlight: 1}, SimConfig{Seed: 5})
	ev, open := e.pendingEvent(t)
	inflight, err := e.s.Submit(Request{Dir: Store, After: ev, Segments: []Segment{{Dev: e.dev, Host: e.host, Len: 64}}})
	require.NoError(t, err)
	queued, err := e.s.Submit(Request{Dir: Store, Segments: []Segment{{Dev: e.dev + 64, Host: e.host + 64, Len: 64}}})
	require.NoError(t, err)
	lost := &cuda.Error{Op: cuda.OpEventQuery, Code: cuda.ErrorIllegalAddress, Name: "CUDA_ERROR_ILLEGAL_ADDRESS", Text: "an illegal memory access was encountered"}
	e.sim.InjectError(lost)
	open()
	for _, op := range []*Op{inflight, queued} {
		err := op.Wait()
		require.ErrorIs(t, err, lost)
		require.ErrorIs(t, err, ErrDeviceLost)
	}
	_, err = e.s.Submit(Request{Dir: Load, Segments: []Segment{{Dev: e.dev, Host: e.host, Len: 64}}})
	require.ErrorIs(t, err, ErrDeviceLost)
	require.ErrorIs(t, err, lost)
}

// TestStoreWaitsForProducer: a "kernel" on the caller's stream writes the
// blocks behind a gate and records the After event; the store must read
// the produced bytes. Without After the same store reads the old bytes,
// proving the check can fail.
func TestStoreWaitsForProducer(t *testing.T) {
	for _, wait := range []bool{true, false} {
		t.Run(fmt.Sprintf("wait=%v", wait), func(t *testing.T) {
			e := newSimEnv(t, 1<<20, Config{}, SimConfig{Seed: 6, MaxDelay: 50 * time.Microsecond})
			const n = 64 << 10
			produced := randBytes(rand.New(rand.NewSource(7)), n)
			open, err := e.sim.Gate(e.callerStrm)
			require.NoError(t, err)
			require.NoError(t, e.sim.Launch(e.callerStrm, func() { require.NoError(t, e.sim.Write(e.dev, produced)) }))
			ev, err := e.sim.CreateEvent(false)
			require.NoError(t, err)
			require.NoError(t, e.sim.RecordEvent(ev, e.callerStrm))
			req := Request{Dir: Store, Segments: []Segment{{Dev: e.dev, Host: e.host, Len: n}}}
			if wait {
				req.After = ev
				req.AfterStream = &e.callerStrm
			}
			op, err := e.s.Submit(req)
			require.NoError(t, err)
			if wait {
				select {
				case <-op.Done():
					t.Fatal("store completed before its producer ran")
				default:
				}
				open()
				require.NoError(t, op.Wait())
				require.Equal(t, produced, e.hostBuf[:n])
			} else {
				require.NoError(t, op.Wait())
				open()
				require.NotEqual(t, produced, e.hostBuf[:n], "a store that does not wait must read the old bytes")
			}
			require.NoError(t, e.sim.StreamSynchronize(e.callerStrm))
		})
	}
}

// TestWriteAfterRead: the caller overwrites the device blocks right after a
// store, waiting only on the store's event; the host keeps the old bytes.
// Without the wait the overwrite lands first.
func TestWriteAfterRead(t *testing.T) {
	for _, wait := range []bool{true, false} {
		t.Run(fmt.Sprintf("wait=%v", wait), func(t *testing.T) {
			e := newSimEnv(t, 1<<20, Config{}, SimConfig{Seed: 8, MaxDelay: 50 * time.Microsecond})
			const n = 32 << 10
			r := rand.New(rand.NewSource(9))
			old, next := randBytes(r, n), randBytes(r, n)
			require.NoError(t, e.sim.Write(e.dev, old))
			// The store's own stream is held by a pending After event, so
			// an unordered overwrite is certain to win.
			ev, open := e.pendingEvent(t)
			op, err := e.s.Submit(Request{Dir: Store, After: ev, Events: true, Segments: []Segment{{Dev: e.dev, Host: e.host, Len: n}}})
			require.NoError(t, err)
			writer := e.sim.NewStream()
			if wait {
				sev, err := op.Event()
				require.NoError(t, err)
				require.NoError(t, e.sim.StreamWaitEvent(writer, sev))
			}
			require.NoError(t, e.sim.Launch(writer, func() { require.NoError(t, e.sim.Write(e.dev, next)) }))
			if !wait {
				require.NoError(t, e.sim.StreamSynchronize(writer))
			}
			open()
			require.NoError(t, op.Wait())
			require.NoError(t, e.sim.StreamSynchronize(writer))
			if wait {
				require.Equal(t, old, e.hostBuf[:n])
			} else {
				require.Equal(t, next, e.hostBuf[:n], "without the wait the overwrite must be stored")
			}
			require.NoError(t, op.Release())
		})
	}
}

// TestLayerEvents: a load of 4 layers with events; a caller stream per
// layer waits on its layer's event and checks that layer's bytes at once.
func TestLayerEvents(t *testing.T) {
	const layers, seg = 4, 8 << 10
	e := newSimEnv(t, 1<<20, Config{}, SimConfig{Seed: 10, MaxDelay: 100 * time.Microsecond})
	r := rand.New(rand.NewSource(11))
	data := randBytes(r, layers*2*seg)
	copy(e.hostBuf, data)
	var segs []Segment
	var ends []int
	for l := range layers {
		for kv := range 2 {
			off := uint64(l*2+kv) * seg
			// Device blocks interleaved so that layers do not coalesce.
			segs = append(segs, Segment{Dev: e.dev + 2*off, Host: e.host + off, Len: seg})
		}
		ends = append(ends, len(segs))
	}
	signal, err := e.sim.CreateEvent(false)
	require.NoError(t, err)
	op, err := e.s.Submit(Request{Dir: Load, Segments: segs, LayerEnds: ends, Events: true, Signal: signal})
	require.NoError(t, err)
	require.Equal(t, layers, op.Layers())
	var mu sync.Mutex
	var order []int
	bad := make(chan string, layers+1)
	check := func(l int) {
		for _, g := range segs[l*2 : l*2+2] {
			got := make([]byte, g.Len)
			if err := e.sim.Read(g.Dev, got); err != nil || !bytes.Equal(got, data[g.Host-e.host:g.Host-e.host+g.Len]) {
				bad <- fmt.Sprintf("layer %d not loaded when its event fired (%v)", l, err)
			}
		}
	}
	var streams []Stream
	for l := range layers {
		lev, err := op.LayerEvent(l)
		require.NoError(t, err)
		st := e.sim.NewStream()
		streams = append(streams, st)
		require.NoError(t, e.sim.StreamWaitEvent(st, lev))
		require.NoError(t, e.sim.Launch(st, func() {
			check(l)
			mu.Lock()
			order = append(order, l)
			mu.Unlock()
		}))
	}
	sst := e.sim.NewStream()
	require.NoError(t, e.sim.StreamWaitEvent(sst, signal))
	require.NoError(t, e.sim.Launch(sst, func() {
		for l := range layers {
			check(l)
		}
	}))
	streams = append(streams, sst)
	require.NoError(t, op.Wait())
	for _, st := range streams {
		require.NoError(t, e.sim.StreamSynchronize(st))
	}
	close(bad)
	for msg := range bad {
		t.Error(msg)
	}
	require.Len(t, order, layers)
	_, err = op.LayerEvent(layers)
	require.ErrorIs(t, err, ErrInvalidRequest)
	require.NoError(t, op.Release())
}

func TestReleasedOp(t *testing.T) {
	e := newSimEnv(t, 1<<20, Config{}, SimConfig{Seed: 12})
	req := Request{Dir: Load, Events: true, Segments: []Segment{{Dev: e.dev, Host: e.host, Len: 4096}}}
	op, err := e.s.Submit(req)
	require.NoError(t, err)
	ev, err := op.Event()
	require.NoError(t, err)
	require.NoError(t, op.Wait())
	require.NoError(t, op.Release())
	_, err = op.Event()
	require.ErrorIs(t, err, ErrReleased)
	_, err = op.LayerEvent(0)
	require.ErrorIs(t, err, ErrReleased)
	require.ErrorIs(t, op.Err(), ErrReleased)
	require.ErrorIs(t, op.Release(), ErrReleased)
	// The pooled event is reused by the next op only now.
	op2, err := e.s.Submit(req)
	require.NoError(t, err)
	ev2, err := op2.Event()
	require.NoError(t, err)
	require.Equal(t, ev, ev2)
	// An op released before it completes keeps its events until it does.
	hold, open := e.pendingEvent(t)
	op3, err := e.s.Submit(Request{Dir: Load, After: hold, Events: true, Segments: req.Segments})
	require.NoError(t, err)
	ev3, err := op3.Event()
	require.NoError(t, err)
	require.NoError(t, op3.Release())
	op4, err := e.s.Submit(req)
	require.NoError(t, err)
	ev4, err := op4.Event()
	require.NoError(t, err)
	require.NotEqual(t, ev3, ev4)
	open()
	<-op3.Done()
	require.NoError(t, op2.Wait())
	require.NoError(t, op4.Wait())
	_, err = op.Event()
	require.ErrorIs(t, err, ErrReleased)
	_, err = (&Op{}).Event()
	require.ErrorIs(t, err, ErrInvalidRequest)
}

func TestCloseRefusesAndDrains(t *testing.T) {
	sim, err := NewSim(SimConfig{Seed: 13, MaxDelay: 100 * time.Microsecond})
	require.NoError(t, err)
	defer func() { require.NoError(t, sim.Close()) }()
	dev, err := sim.MemAlloc(1 << 16)
	require.NoError(t, err)
	hb, err := unix.Mmap(-1, 0, 1<<16, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	require.NoError(t, err)
	defer func() { require.NoError(t, unix.Munmap(hb)) }()
	host, err := sim.RegisterHost(hb)
	require.NoError(t, err)
	s, err := New(sim, Config{MaxInFlightBytes: 4096, MaxBatchesInFlight: 1})
	require.NoError(t, err)
	require.NoError(t, s.AddDeviceRange(dev, 1<<16))
	require.NoError(t, s.AddHostRange(host, 1<<16))
	var ops []*Op
	for i := range 8 {
		op, err := s.Submit(Request{Dir: Store, Segments: []Segment{{Dev: dev + uint64(i)*4096, Host: host + uint64(i)*4096, Len: 4096}}})
		require.NoError(t, err)
		ops = append(ops, op)
	}
	require.NoError(t, s.Close())
	for _, op := range ops {
		require.NoError(t, op.Wait())
	}
	_, err = s.Submit(Request{Dir: Store, Segments: []Segment{{Dev: dev, Host: host, Len: 4096}}})
	require.ErrorIs(t, err, ErrClosed)
}
