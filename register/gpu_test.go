package register_test

import (
	"bytes"
	"math/rand/v2"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/kvoffload/kvoffload/mmapmem"
	"github.com/kvoffload/kvoffload/register"
)

const gib = 1 << 30

// TestGPURegister registers and unregisters 1 GiB (and 48 GiB with
// KVO_BIG=1) on the real driver, once in one range, once in 256 MiB
// ranges, and pipelined (a DeferPrefault region in 256 MiB and 2 GiB
// ranges), and checks the device pointer of every range start and, when
// pipelined, that every page is resident.
func TestGPURegister(t *testing.T) {
	g := cudatest.Open(t)
	sizes := []int64{gib + 4097}
	if os.Getenv("KVO_BIG") == "1" {
		sizes = append(sizes, 48*gib)
	}
	modes := []struct {
		limit, chunk int64
		deferred     bool
	}{{0, 0, false}, {256 << 20, 0, false}, {0, 256 << 20, true}, {0, 0, true}}
	for _, size := range sizes {
		for _, m := range modes {
			p, err := register.NewCUDA(cudadev.Bind(g.Drv, g.Ctx), register.CUDAOptions{RangeLimit: m.limit, PipelineChunk: m.chunk})
			require.NoError(t, err)
			start := time.Now()
			r, err := mmapmem.New(size, mmapmem.Options{DeferPrefault: m.deferred})
			require.NoError(t, err)
			mapped := time.Since(start)
			require.NoError(t, p.Register(r))
			if m.deferred {
				pages, total, err := mmapmem.Resident(r)
				require.NoError(t, err)
				require.Equal(t, total, pages, "every page resident after a pipelined Register")
			}
			ranges := p.Ranges(r)
			for _, rg := range ranges {
				dp, err := g.Drv.MemHostGetDevicePointer(unsafeAdd(r, rg.Off))
				require.NoError(t, err)
				require.NotZero(t, dp)
			}
			st := p.Stats()
			t.Logf("%d bytes in %d ranges, pipelined %v: New %v, Register %v (%.1f GiB/s end to end)",
				size, len(ranges), m.deferred, mapped, st.RegisterTime, float64(size)/gib/(mapped+st.RegisterTime).Seconds())
			require.NoError(t, register.Release(p, r))
			require.Zero(t, p.Stats().RegisteredBytes)
		}
	}
}

// roundTrip registers two regions of an odd size, fills the first with
// random bytes, copies it to the GPU from src (a host address the driver
// accepts) and back into the second, and compares.
// It runs against the fake driver in CI too.
func roundTrip(t *testing.T, g *cudatest.GPU, src func(r *mmapmem.Region) cuda.DevicePtr) {
	const size = 64<<20 + 12345
	p, err := register.NewCUDA(cudadev.Bind(g.Drv, g.Ctx), register.CUDAOptions{})
	require.NoError(t, err)
	a, err := mmapmem.New(size, mmapmem.Options{})
	require.NoError(t, err)
	b, err := mmapmem.New(size, mmapmem.Options{Memfd: true})
	require.NoError(t, err)
	require.NoError(t, p.Register(a))
	require.NoError(t, p.Register(b))
	defer func() {
		require.NoError(t, register.Release(p, a))
		require.NoError(t, register.Release(p, b))
	}()
	rng := rand.NewChaCha8([32]byte{7})
	_, _ = rng.Read(a.Bytes())

	d, err := g.Drv.MemAlloc(size)
	require.NoError(t, err)
	defer func() { require.NoError(t, g.Drv.MemFree(d)) }()
	require.NoError(t, g.Drv.Memcpy(d, src(a), size))
	require.NoError(t, g.Drv.Memcpy(cuda.DevicePtr(b.Addr()), d, size))
	require.True(t, bytes.Equal(a.Bytes(), b.Bytes()), "DMA round trip is byte-exact")
}

func TestGPUDMARoundTrip(t *testing.T) {
	g := cudatest.Open(t)
	roundTrip(t, g, func(r *mmapmem.Region) cuda.DevicePtr { return cuda.DevicePtr(r.Addr()) })
}

func TestGPUDevicePointer(t *testing.T) {
	g := cudatest.Open(t)
	roundTrip(t, g, devicePointer(t, g))
}

func devicePointer(t *testing.T, g *cudatest.GPU) func(r *mmapmem.Region) cuda.DevicePtr {
	return func(r *mmapmem.Region) cuda.DevicePtr {
		dp, err := g.Drv.MemHostGetDevicePointer(r.Pointer())
		require.NoError(t, err)
		return dp
	}
}

// TestFakeDMARoundTrip runs the round trip on the fake driver, which
// refuses copies touching memory that is not registered.
func TestFakeDMARoundTrip(t *testing.T) {
	fd := cudafake.New(cudafake.Options{})
	defer func() { require.NoError(t, fd.Close()) }()
	ctx, err := fd.PrimaryCtxRetain(0)
	require.NoError(t, err)
	defer func() { require.NoError(t, fd.PrimaryCtxRelease(0)) }()
	g := &cudatest.GPU{Drv: fd, Ctx: ctx}
	roundTrip(t, g, devicePointer(t, g))
	require.Equal(t, cudafake.Counts{PrimaryCtxRefs: 1}, fd.Live(), "nothing left but the context")
}
