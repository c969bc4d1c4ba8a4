package register_test

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"
	"pgregory.net/rapid"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/kvoffload/kvoffload/mmapmem"
	"github.com/kvoffload/kvoffload/register"
)

// resident reports whether every base page of bytes [off, off+n) of r is
// resident (mincore(2)).
func resident(t require.TestingT, r *mmapmem.Region, off, n int64) bool {
	page := int64(os.Getpagesize())
	vec := make([]byte, (n+page-1)/page)
	_, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Add(r.Pointer(), off)), uintptr(n), uintptr(unsafe.Pointer(&vec[0])))
	if errno != 0 {
		require.NoError(t, errno)
	}
	for _, v := range vec {
		if v&1 == 0 {
			return false
		}
	}
	return true
}

// wantRanges is r's mapping cut into ranges of at most step bytes.
func wantRanges(r *mmapmem.Region, step int64) []register.Range {
	var out []register.Range
	for off := int64(0); off < r.Mapped(); off += step {
		out = append(out, register.Range{Off: off, Len: min(step, r.Mapped()-off)})
	}
	return out
}

func deferred(t require.TestingT, size int64) *mmapmem.Region {
	r, err := mmapmem.New(size, mmapmem.Options{DeferPrefault: true, NoTHP: true, PrefaultThreads: 2})
	require.NoError(t, err)
	return r
}

// TestPipelinedRegister registers regions mapped with DeferPrefault over a
// table of sizes, range limits and pipeline chunks and checks that the
// ranges reported are those registered with the driver, one call each in
// order, that every range was resident when the driver saw it, and that
// the whole mapping is resident afterwards.
func TestPipelinedRegister(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	cases := []struct{ size, limit, chunk, step int64 }{
		{1, 0, 0, 4 * kib},
		{200*kib + 5, 0, 0, 204 * kib},
		{200*kib + 5, 0, 64 * kib, 64 * kib},
		{200*kib + 5, 64 * kib, 16 * kib, 16 * kib},
		{200*kib + 5, 32 * kib, 64 * kib, 32 * kib},
		{mib, 0, 4 * kib, 4 * kib},
		{mib + 1, mib, 256 * kib, 256 * kib},
		{3 * mib, 0, 2 * mib, 2 * mib},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("%d/%d/%d", c.size, c.limit, c.chunk), func(t *testing.T) {
			rec, p := newFakeWith(t, register.CUDAOptions{RangeLimit: c.limit, PipelineChunk: c.chunk})
			r := deferred(t, c.size)
			rec.base = r.Addr()
			var mu sync.Mutex
			var notResident []int64
			rec.before = func(off, n int64) {
				if !resident(t, r, off, n) {
					mu.Lock()
					notResident = append(notResident, off)
					mu.Unlock()
				}
			}
			require.NoError(t, p.Register(r))
			want := wantRanges(r, c.step)
			require.Equal(t, want, p.Ranges(r))
			var calls []call
			for _, rg := range want {
				calls = append(calls, call{Off: rg.Off, Len: rg.Len})
			}
			require.Equal(t, calls, rec.log(), "exactly the ranges reported were registered, in order")
			require.Empty(t, notResident, "ranges registered before their prefault ended")
			pages, total, err := mmapmem.Resident(r)
			require.NoError(t, err)
			require.Equal(t, total, pages, "every page resident")
			require.Equal(t, r.Mapped(), p.Stats().RegisteredBytes)
			require.NoError(t, register.Release(p, r))
		})
	}
}

// TestPipelineChunkOnlyForDeferred: a region prefaulted by New keeps the
// range limit, whatever the pipeline chunk.
func TestPipelineChunkOnlyForDeferred(t *testing.T) {
	_, p := newFakeWith(t, register.CUDAOptions{RangeLimit: 64 * kib, PipelineChunk: 16 * kib})
	r := newRegion(t, 200*kib)
	require.NoError(t, p.Register(r))
	require.Equal(t, wantRanges(r, 64*kib), p.Ranges(r))
	require.NoError(t, register.Release(p, r))
}

// TestPrefetchedRegionNotPrefaultedAgain: a region mapped with
// DeferPrefault and then prefaulted whole (mmapmem.Region.Prefault of its
// mapping, as offload's growth prefetch does) is resident, so Register
// takes the plain path: no prefault call, ranges of the range limit.
func TestPrefetchedRegionNotPrefaultedAgain(t *testing.T) {
	var prefaults int
	register.SetPrefault(t, func(r *mmapmem.Region, off, n int64) error {
		prefaults++
		return r.Prefault(off, n)
	})
	_, p := newFakeWith(t, register.CUDAOptions{RangeLimit: 64 * kib, PipelineChunk: 16 * kib})
	r := deferred(t, 200*kib)
	require.NoError(t, r.Prefault(0, r.Mapped()))
	require.False(t, r.Deferred())
	require.NoError(t, p.Register(r))
	require.Zero(t, prefaults, "a resident region is not prefaulted again")
	require.Equal(t, wantRanges(r, 64*kib), p.Ranges(r))
	require.NoError(t, register.Release(p, r))
}

func TestPipelineChunkOptions(t *testing.T) {
	fd, _ := newFake(t, 0)
	for _, chunk := range []int64{-4096, 1000, 4097} {
		_, err := register.NewCUDA(cudadev.Bind(fd, 0), register.CUDAOptions{PipelineChunk: chunk})
		require.ErrorIs(t, err, register.ErrOptions)
		require.ErrorContains(t, err, fmt.Sprintf("PipelineChunk %d", chunk))
	}
}

// TestPipelinedRollback fails the registration of range k while the
// prefault of range k+1 has finished (the driver call waits for it), and
// checks that ranges 0..k-1 were unregistered newest first, the error
// names range k, the prefaulting goroutine is gone, and the region can be
// registered again.
func TestPipelinedRollback(t *testing.T) {
	const chunk = 64 * kib
	const n = 5
	for k := range n {
		t.Run(fmt.Sprint("range ", k), func(t *testing.T) {
			rec, p := newFakeWith(t, register.CUDAOptions{PipelineChunk: chunk})
			r := deferred(t, n*chunk-100)
			t.Cleanup(func() { _ = r.Close() })
			rec.base = r.Addr()
			rec.before = func(off, _ int64) {
				if off == int64(k)*chunk && k+1 < n {
					// Block the failing call until the prefaulter is past
					// range k+1: the pipeline is in flight when it fails.
					for !resident(t, r, off+chunk, chunk) {
						runtime.Gosched()
					}
				}
			}
			rec.FailAt(cuda.OpMemHostRegister, k+1, cuda.ErrorOutOfMemory)
			ign := goleak.IgnoreCurrent()
			err := p.Register(r)
			goleak.VerifyNone(t, ign)

			var re *register.RangeError
			require.ErrorAs(t, err, &re)
			require.Equal(t, k, re.Index)
			require.Equal(t, n, re.Count)
			require.Equal(t, register.Range{Off: int64(k) * chunk, Len: chunk}, re.Range)
			require.True(t, cuda.IsCode(err, cuda.ErrorOutOfMemory))
			require.ErrorContains(t, err, fmt.Sprintf("register: cuda: range %d of %d (offset %d, %d bytes)", k, n, k*chunk, chunk))
			var want []call
			for i := range k {
				want = append(want, call{Off: int64(i) * chunk, Len: chunk})
			}
			for i := k - 1; i >= 0; i-- {
				want = append(want, call{Unregister: true, Off: int64(i) * chunk})
			}
			require.Equal(t, want, rec.log())
			require.False(t, p.Registered(r))
			require.Empty(t, r.Holders())
			require.Zero(t, p.Stats().RegisteredBytes)

			rec.before = nil
			require.NoError(t, p.Register(r), "a region whose registration failed registers again")
			require.Len(t, p.Ranges(r), n)
			require.NoError(t, register.Release(p, r))
		})
	}
}

// TestPipelinedPrefaultFailure makes the prefault of range k fail and
// checks the same rollback as for a pinning failure, with the prefault's
// error kept and the range named.
func TestPipelinedPrefaultFailure(t *testing.T) {
	const chunk = 64 * kib
	const n = 4
	errPrefault := errors.New("prefault refused")
	for k := range n {
		t.Run(fmt.Sprintf("range %d", k), func(t *testing.T) {
			rec, p := newFakeWith(t, register.CUDAOptions{PipelineChunk: chunk})
			r := deferred(t, n*chunk)
			rec.base = r.Addr()
			register.SetPrefault(t, func(r *mmapmem.Region, off, n int64) error {
				if off == int64(k)*chunk {
					return errPrefault
				}
				return r.Prefault(off, n)
			})
			ign := goleak.IgnoreCurrent()
			err := p.Register(r)
			goleak.VerifyNone(t, ign)

			var re *register.RangeError
			require.ErrorAs(t, err, &re)
			require.Equal(t, k, re.Index)
			require.ErrorIs(t, err, errPrefault)
			require.ErrorContains(t, err, fmt.Sprintf("register: cuda: range %d of %d (offset %d, %d bytes)", k, n, k*chunk, chunk))
			require.False(t, p.Registered(r))
			require.Empty(t, r.Holders())
			require.Zero(t, p.Stats().RegisteredBytes)
			var want []call
			for i := range k {
				want = append(want, call{Off: int64(i) * chunk, Len: chunk})
			}
			for i := k - 1; i >= 0; i-- {
				want = append(want, call{Unregister: true, Off: int64(i) * chunk})
			}
			require.Equal(t, want, rec.log())
			require.NoError(t, r.Close())
		})
	}
}

// TestPipelineProperty draws a size, range limit, pipeline chunk and an
// optional failing range, and checks the reported ranges against the
// model (contiguous, covering the mapping, each at most min(limit, chunk)
// rounded to the page, never straddled), exactly those registered, every
// page resident on success, and on failure at k a rollback of 0..k-1 with
// nothing left registered or held.
func TestPipelineProperty(t *testing.T) {
	page := int64(os.Getpagesize())
	rapid.Check(t, func(rt *rapid.T) {
		size := rapid.Int64Range(1, 600*kib).Draw(rt, "size")
		limit := rapid.Int64Range(0, 40).Draw(rt, "limit pages") * page
		chunk := rapid.Int64Range(0, 40).Draw(rt, "chunk pages") * page
		fd := cudafake.New(cudafake.Options{CheckContext: true})
		defer func() { require.NoError(rt, fd.Close()) }()
		rec := &recorder{Driver: fd}
		ctx, err := fd.PrimaryCtxRetain(0)
		require.NoError(rt, err)
		defer func() { require.NoError(rt, fd.PrimaryCtxRelease(0)) }()
		p, err := register.NewCUDA(cudadev.Bind(rec, ctx), register.CUDAOptions{RangeLimit: limit, PipelineChunk: chunk})
		require.NoError(rt, err)
		r := deferred(rt, size)
		defer func() { require.NoError(rt, r.Close()) }()
		rec.base = r.Addr()
		step := r.Mapped()
		if limit > 0 {
			step = limit
		}
		if chunk == 0 {
			chunk = register.DefaultPipelineChunk
		}
		step = min(step, chunk)
		want := wantRanges(r, step)
		fail := rapid.IntRange(-1, len(want)-1).Draw(rt, "failing range")
		if fail >= 0 {
			rec.FailAt(cuda.OpMemHostRegister, fail+1, cuda.ErrorOutOfMemory)
		}
		err = p.Register(r)
		if fail < 0 {
			require.NoError(rt, err)
			got := p.Ranges(r)
			require.Equal(rt, want, got)
			for i, rg := range got {
				require.LessOrEqual(rt, rg.Len, step)
				require.Zero(rt, rg.Off%r.PageSize())
				if i > 0 {
					require.Equal(rt, got[i-1].Off+got[i-1].Len, rg.Off)
				}
			}
			require.Equal(rt, r.Mapped(), got[len(got)-1].Off+got[len(got)-1].Len)
			require.Len(rt, rec.log(), len(want))
			pages, total, err := mmapmem.Resident(r)
			require.NoError(rt, err)
			require.Equal(rt, total, pages)
			require.NoError(rt, p.Unregister(r))
			return
		}
		var re *register.RangeError
		require.ErrorAs(rt, err, &re)
		require.Equal(rt, fail, re.Index)
		require.Equal(rt, want[fail], re.Range)
		log := rec.log()
		require.Len(rt, log, 2*fail)
		for i, c := range log {
			if i < fail {
				require.Equal(rt, call{Off: want[i].Off, Len: want[i].Len}, c)
			} else {
				require.Equal(rt, call{Unregister: true, Off: want[2*fail-1-i].Off}, c)
			}
		}
		require.False(rt, p.Registered(r))
		require.Empty(rt, r.Holders())
		require.Zero(rt, rec.Live().Registrations)
	})
}
