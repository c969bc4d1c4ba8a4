package register_test

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/kvoffload/kvoffload/mmapmem"
	"github.com/kvoffload/kvoffload/register"
)

const (
	kib = 1 << 10
	mib = 1 << 20
)

// call is one registration call the recorder saw, as offsets into a region.
type call struct {
	Unregister bool
	Off, Len   int64
}

// recorder is the fake driver, logging MemHostRegister/MemHostUnregister
// and capture-mode exchanges.
type recorder struct {
	*cudafake.Driver
	mu    sync.Mutex
	base  uintptr
	calls []call
	modes []cuda.CaptureMode
	// before, when set, runs at the start of every MemHostRegister with the
	// range as offsets into the region.
	before func(off, n int64)
}

func (r *recorder) MemHostRegister(p unsafe.Pointer, size uint64, flags uint32) error {
	if r.before != nil {
		r.before(int64(uintptr(p)-r.base), int64(size))
	}
	err := r.Driver.MemHostRegister(p, size, flags)
	if err == nil {
		r.mu.Lock()
		r.calls = append(r.calls, call{Off: int64(uintptr(p) - r.base), Len: int64(size)})
		r.mu.Unlock()
	}
	return err
}

func (r *recorder) MemHostUnregister(p unsafe.Pointer) error {
	err := r.Driver.MemHostUnregister(p)
	if err == nil {
		r.mu.Lock()
		r.calls = append(r.calls, call{Unregister: true, Off: int64(uintptr(p) - r.base)})
		r.mu.Unlock()
	}
	return err
}

func (r *recorder) ThreadExchangeStreamCaptureMode(m cuda.CaptureMode) (cuda.CaptureMode, error) {
	r.mu.Lock()
	r.modes = append(r.modes, m)
	r.mu.Unlock()
	return r.Driver.ThreadExchangeStreamCaptureMode(m)
}

func (r *recorder) log() []call {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]call(nil), r.calls...)
}

// newFake returns a recording fake driver that checks the calling thread
// has the context current, a CUDA pinner on it with the given range limit,
// and a cleanup that asserts nothing is left registered.
func newFake(t *testing.T, limit int64) (*recorder, register.Pinner) {
	t.Helper()
	return newFakeWith(t, register.CUDAOptions{RangeLimit: limit})
}

// newFakeWith is newFake with all the pinner's options.
func newFakeWith(t *testing.T, opts register.CUDAOptions) (*recorder, register.Pinner) {
	t.Helper()
	fd := cudafake.New(cudafake.Options{CheckContext: true})
	rec := &recorder{Driver: fd}
	ctx, err := fd.PrimaryCtxRetain(0)
	require.NoError(t, err)
	p, err := register.NewCUDA(cudadev.Bind(rec, ctx), opts)
	require.NoError(t, err)
	t.Cleanup(func() {
		require.Zero(t, fd.Live().Registrations, "registrations left in the fake driver")
		require.NoError(t, fd.PrimaryCtxRelease(0))
		require.NoError(t, fd.Close())
	})
	return rec, p
}

func newRegion(t *testing.T, size int64) *mmapmem.Region {
	t.Helper()
	r, err := mmapmem.New(size, mmapmem.Options{})
	require.NoError(t, err)
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			require.ErrorIs(t, err, mmapmem.ErrClosed)
		}
	})
	return r
}

func pinners(t *testing.T) map[string]register.Pinner {
	_, c := newFake(t, 64*kib)
	return map[string]register.Pinner{"cuda": c}
}

func TestLifecycle(t *testing.T) {
	for kind, p := range pinners(t) {
		t.Run(kind, func(t *testing.T) {
			require.Equal(t, kind, p.Kind())
			r := newRegion(t, 200*kib+5)
			require.False(t, p.Registered(r))
			require.Nil(t, p.Ranges(r))

			require.NoError(t, p.Register(r))
			require.True(t, p.Registered(r))
			ranges := p.Ranges(r)
			require.NotEmpty(t, ranges)
			require.Zero(t, ranges[0].Off)
			for i := 1; i < len(ranges); i++ {
				require.Equal(t, ranges[i-1].Off+ranges[i-1].Len, ranges[i].Off, "ranges are contiguous")
			}
			require.Equal(t, r.Mapped(), ranges[len(ranges)-1].Off+ranges[len(ranges)-1].Len, "ranges cover the mapping")

			err := r.Close()
			require.ErrorIs(t, err, mmapmem.ErrHeld, "a registered region cannot be closed")
			require.Contains(t, err.Error(), kind+" registration")
			require.ErrorIs(t, p.Register(r), register.ErrAlreadyRegistered)

			st := p.Stats()
			require.Equal(t, 1, st.Regions)
			require.Equal(t, r.Mapped(), st.RegisteredBytes)
			require.Equal(t, r.Mapped(), st.PeakRegisteredBytes)
			require.Equal(t, int64(1), st.RegisterCalls)

			require.NoError(t, p.Unregister(r))
			require.False(t, p.Registered(r))
			require.Nil(t, p.Ranges(r))
			require.ErrorIs(t, p.Unregister(r), register.ErrNotRegistered)
			st = p.Stats()
			require.Zero(t, st.Regions)
			require.Zero(t, st.RegisteredBytes)
			require.Equal(t, r.Mapped(), st.PeakRegisteredBytes)
			require.Equal(t, int64(1), st.UnregisterCalls)
			require.LessOrEqual(t, st.MaxRegisterTime, st.RegisterTime)
			require.LessOrEqual(t, st.MaxUnregisterTime, st.UnregisterTime)

			require.NoError(t, p.Register(r))
			require.NoError(t, register.Release(p, r))
			require.False(t, p.Registered(r))
			require.ErrorIs(t, register.Release(p, r), mmapmem.ErrClosed)
			require.ErrorIs(t, p.Register(r), mmapmem.ErrClosed, "a closed region cannot be registered")
			require.Equal(t, int64(2), p.Stats().RegisterCalls, "a call refused before pinning is not counted")
		})
	}
}

func TestNilRegion(t *testing.T) {
	_, p := newFake(t, 0)
	require.ErrorContains(t, p.Register(nil), "nil region")
}

func TestCUDARanges(t *testing.T) {
	cases := []struct {
		size, limit int64
		want        []register.Range
	}{
		{4 * kib, 0, []register.Range{{0, 4 * kib}}},
		{64 * kib, 64 * kib, []register.Range{{0, 64 * kib}}},
		{64*kib + 1, 64 * kib, []register.Range{{0, 64 * kib}, {64 * kib, 4 * kib}}},
		{200 * kib, 64 * kib, []register.Range{{0, 64 * kib}, {64 * kib, 64 * kib}, {128 * kib, 64 * kib}, {192 * kib, 8 * kib}}},
		{12*kib - 7, 4 * kib, []register.Range{{0, 4 * kib}, {4 * kib, 4 * kib}, {8 * kib, 4 * kib}}},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("%d/%d", c.size, c.limit), func(t *testing.T) {
			rec, p := newFake(t, c.limit)
			r, err := mmapmem.New(c.size, mmapmem.Options{NoTHP: true})
			require.NoError(t, err)
			rec.base = r.Addr()
			require.NoError(t, p.Register(r))
			require.Equal(t, c.want, p.Ranges(r))
			var want []call
			for _, rg := range c.want {
				want = append(want, call{Off: rg.Off, Len: rg.Len})
			}
			require.Equal(t, want, rec.log(), "one driver registration per range, in order")
			require.NoError(t, register.Release(p, r))
		})
	}
}

func TestNewCUDAOptions(t *testing.T) {
	_, err := register.NewCUDA(nil, register.CUDAOptions{})
	require.ErrorIs(t, err, cuda.ErrNoDriver)
	fd := cudafake.New(cudafake.Options{})
	defer func() { require.NoError(t, fd.Close()) }()
	for _, limit := range []int64{-4096, 1000, register.MaxRangeSize + 4096} {
		_, err := register.NewCUDA(cudadev.Bind(fd, 0), register.CUDAOptions{RangeLimit: limit})
		require.ErrorIs(t, err, register.ErrOptions)
		require.Contains(t, err.Error(), fmt.Sprint(limit))
		require.Contains(t, err.Error(), fmt.Sprint(register.MaxRangeSize))
	}
}

// TestCUDARollback injects a failure at range k of a five-range region and
// checks that exactly ranges 0..k-1 were registered and then unregistered,
// newest first.
func TestCUDARollback(t *testing.T) {
	const limit = 64 * kib
	const n = 5
	for k := range n {
		t.Run(fmt.Sprint("range ", k), func(t *testing.T) {
			rec, p := newFake(t, limit)
			r := newRegion(t, n*limit-100)
			rec.base = r.Addr()
			rec.FailAt(cuda.OpMemHostRegister, k+1, cuda.ErrorOutOfMemory)

			err := p.Register(r)
			var re *register.RangeError
			require.ErrorAs(t, err, &re)
			require.Equal(t, k, re.Index)
			require.Equal(t, n, re.Count)
			require.Equal(t, register.Range{Off: int64(k) * limit, Len: limit}, re.Range)
			require.True(t, cuda.IsCode(err, cuda.ErrorOutOfMemory), "the driver's reason is kept: %v", err)
			require.Contains(t, err.Error(), fmt.Sprintf("range %d of %d (offset %d, %d bytes)", k, n, k*limit, limit))
			require.Contains(t, err.Error(), "CUDA_ERROR_OUT_OF_MEMORY")

			var want []call
			for i := range k {
				want = append(want, call{Off: int64(i) * limit, Len: limit})
			}
			for i := k - 1; i >= 0; i-- {
				want = append(want, call{Unregister: true, Off: int64(i) * limit})
			}
			require.Equal(t, want, rec.log())
			require.False(t, p.Registered(r))
			require.Empty(t, r.Holders(), "a failed Register leaves the region unheld")
			st := p.Stats()
			require.Zero(t, st.RegisteredBytes)
			require.Equal(t, int64(1), st.RegisterFailures)
			require.NoError(t, r.Close())
		})
	}
}

func TestCUDARollbackFailureKeepsRegion(t *testing.T) {
	rec, p := newFake(t, 64*kib)
	r := newRegion(t, 256*kib)
	rec.base = r.Addr()
	rec.FailAt(cuda.OpMemHostRegister, 3, cuda.ErrorOutOfMemory)
	rec.FailAt(cuda.OpMemHostUnregister, 1, cuda.ErrorUnknown) // the rollback of range 1 fails

	err := p.Register(r)
	require.ErrorContains(t, err, "range 2 of 4")
	require.ErrorContains(t, err, "rollback left 1 ranges registered")
	require.True(t, p.Registered(r))
	require.Equal(t, []register.Range{{64 * kib, 64 * kib}}, p.Ranges(r))
	require.ErrorIs(t, r.Close(), mmapmem.ErrHeld, "memory still registered with the driver stays mapped")
	require.Equal(t, int64(64*kib), p.Stats().RegisteredBytes)

	require.NoError(t, register.Release(p, r))
	require.Zero(t, p.Stats().RegisteredBytes)
}

func TestCUDAUnregisterFailure(t *testing.T) {
	rec, p := newFake(t, 64*kib)
	r := newRegion(t, 192*kib)
	rec.base = r.Addr()
	require.NoError(t, p.Register(r))
	rec.FailAt(cuda.OpMemHostUnregister, 2, cuda.ErrorInvalidValue) // ranges go newest first: range 1 fails

	err := p.Unregister(r)
	require.ErrorContains(t, err, "unregister range 1 (offset 65536, 65536 bytes)")
	require.True(t, cuda.IsCode(err, cuda.ErrorInvalidValue))
	require.True(t, p.Registered(r))
	require.Equal(t, []register.Range{{64 * kib, 64 * kib}}, p.Ranges(r))
	require.ErrorIs(t, r.Close(), mmapmem.ErrHeld)
	st := p.Stats()
	require.Equal(t, int64(64*kib), st.RegisteredBytes)
	require.Equal(t, int64(1), st.UnregisterFailures)

	require.NoError(t, p.Unregister(r))
	require.False(t, p.Registered(r))
	require.NoError(t, r.Close())
}

// TestCUDAThreads registers from goroutines that are not locked to a thread
// and have never set a context: the fake (CheckContext) fails any call made
// on a thread without the context current, so this passes only if the
// pinner locks the thread and sets the context itself. Each call relaxes the
// capture mode and restores the previous one.
func TestCUDAThreads(t *testing.T) {
	rec, p := newFake(t, 64*kib)
	regions := make([]*mmapmem.Region, 8)
	for i := range regions {
		regions[i] = newRegion(t, int64(i+1)*48*kib)
	}
	var wg sync.WaitGroup
	for _, r := range regions {
		wg.Go(func() {
			for range 5 {
				require.NoError(t, p.Register(r))
				runtime.Gosched()
				require.NoError(t, p.Unregister(r))
			}
		})
	}
	wg.Wait()
	st := p.Stats()
	require.Equal(t, int64(40), st.RegisterCalls)
	require.Equal(t, int64(40), st.UnregisterCalls)
	require.Zero(t, st.RegisteredBytes)
	require.Equal(t, 160, len(rec.modes))
	relaxed := 0
	for _, m := range rec.modes {
		if m == cuda.CaptureModeRelaxed {
			relaxed++
		}
	}
	require.Equal(t, 80, relaxed, "one relax and one restore (to global) per call")
}

// TestCUDAPinningDuringCapture: a serving stack captures a graph in global
// mode on another thread; registering a region must not invalidate it.
func TestCUDAPinningDuringCapture(t *testing.T) {
	rec, p := newFake(t, 64*kib)
	ctx, err := rec.PrimaryCtxRetain(0)
	require.NoError(t, err)
	defer func() { require.NoError(t, rec.PrimaryCtxRelease(0)) }()

	capturing, finish, ended := make(chan struct{}), make(chan struct{}), make(chan error)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		err := rec.CtxSetCurrent(ctx)
		var s cuda.Stream
		if err == nil {
			s, err = rec.StreamCreate(cuda.StreamNonBlocking, 0)
		}
		if err == nil {
			err = rec.StreamBeginCapture(s, cuda.CaptureModeGlobal)
		}
		close(capturing)
		if err != nil {
			ended <- err
			return
		}
		<-finish
		g, err := rec.StreamEndCapture(s)
		if err == nil {
			err = errors.Join(rec.GraphDestroy(g), rec.StreamDestroy(s))
		}
		ended <- err
	}()
	<-capturing
	r := newRegion(t, 128*kib)
	require.NoError(t, p.Register(r))
	require.NoError(t, p.Unregister(r))
	close(finish)
	require.NoError(t, <-ended, "the capture survived the pinning")
}

func unsafeAdd(r *mmapmem.Region, off int64) unsafe.Pointer { return unsafe.Add(r.Pointer(), off) }

// TestConcurrentSameRegion: of many goroutines registering one region at
// once, exactly one succeeds; the others are told it is registered or busy.
func TestConcurrentSameRegion(t *testing.T) {
	for kind, p := range pinners(t) {
		t.Run(kind, func(t *testing.T) {
			r := newRegion(t, 256*kib)
			var mu sync.Mutex
			ok := 0
			var wg sync.WaitGroup
			for range 16 {
				wg.Go(func() {
					err := p.Register(r)
					if err != nil {
						require.True(t, errors.Is(err, register.ErrAlreadyRegistered) || errors.Is(err, register.ErrBusy), "%v", err)
						return
					}
					mu.Lock()
					ok++
					mu.Unlock()
				})
			}
			wg.Wait()
			require.Equal(t, 1, ok)
			require.Equal(t, int64(1), p.Stats().RegisterCalls)
			require.NoError(t, register.Release(p, r))
		})
	}
}
