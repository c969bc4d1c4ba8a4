package cudacopy

import (
	mrand "math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
)

// blockSegs is n blocks of segs segments of seg bytes, block-contiguous on
// the host side and at random device slots: whole blocks, as a staged
// store or load moves them.
func blockSegs(dir Path, host, dev uint64, n, segs int, seg uint64, seed uint64) []Segment {
	perm := mrand.New(mrand.NewPCG(seed, 1)).Perm(n * segs)
	out := make([]Segment, n*segs)
	for i := range out {
		h, d := host+uint64(i)*seg, dev+uint64(perm[i])*seg
		out[i] = Segment{Dst: h, Src: d, Len: seg}
		if dir == H2D {
			out[i] = Segment{Dst: d, Src: h, Len: seg}
		}
	}
	return out
}

// Many large staged copies in flight, none retired, never take the
// Copier's device memory past the default bound: each waits for the oldest
// one's copies instead (the pools used to grow by a ring of staging chunks
// per batch until Close). The data arrives intact, and the bytes are
// reported.
func TestDeviceBudgetDefaultBoundsStagedInFlightFake(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{DeviceMemory: 4 << 30})
	g, s := newStream(t, drv), newStream(t, drv)
	const n = 40 << 20 // 5 chunks of 8 MiB: a full ring of 4 per batch
	src, dst, dev := testBuffers(t, drv, n)
	base := drv.Live().DeviceBytes
	c := newCopier(t, drv, Options{PTX: fakePTX})
	require.EqualValues(t, DefaultMaxDeviceBytes, c.MaxDeviceBytes())
	knownHost(t, c, dst)
	require.NoError(t, drv.Memcpy(dev, cuda.DevicePtr(addr(src)), n))
	segs := blockSegs(D2H, addr(dst), uint64(dev), 40, 8, 128<<10, 1)
	// The device data is src permuted as segs says, so each gather writes
	// src back into dst.
	for _, sg := range segs {
		require.NoError(t, drv.Memcpy(cuda.DevicePtr(sg.Src), cuda.DevicePtr(addr(src)+(sg.Dst-addr(dst))), sg.Len))
	}
	var tks []Ticket
	for range 12 {
		tk, err := c.SubmitGather(g, s, segs)
		require.NoError(t, err)
		tks = append(tks, tk)
		require.LessOrEqual(t, c.DeviceBytes(), int64(DefaultMaxDeviceBytes))
	}
	require.NoError(t, drv.StreamSynchronize(s))
	for _, tk := range tks {
		require.NoError(t, c.Retire(tk))
	}
	require.Equal(t, -1, firstDiff(src, dst))
	require.LessOrEqual(t, c.PeakDeviceBytes(), int64(DefaultMaxDeviceBytes))
	require.LessOrEqual(t, drv.PeakDeviceBytes()-base, uint64(DefaultMaxDeviceBytes), "the fake saw more device memory than the bound")
	require.Positive(t, c.BudgetWaits(), "12 rings of 32 MiB do not fit 256 MiB without waiting")
	require.Positive(t, c.DeviceBytes())
	require.NoError(t, c.Close())
	require.Zero(t, c.DeviceBytes())
}

// A tight bound: kernel copies, gathers and scatters in flight on several
// streams keep under it; a staged copy whose ring does not fit takes fewer
// chunks; a batch that could never fit is ErrDeviceBudget naming the bytes
// and the bound.
func TestDeviceBudgetTightFake(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{MaxDelay: 20_000})
	g, s := newStream(t, drv), newStream(t, drv)
	const n = 6 << 20
	src, dst, dev := testBuffers(t, drv, n)
	dev2 := devMem(t, drv, n)
	base := drv.Live().DeviceBytes
	// Tables of 64 descriptors (2 KiB), chunks of 1 MiB: room for two
	// chunks and a few tables, so a ring of 4 becomes 2.
	maxBytes := int64(2<<20 + 8*64*descSize)
	c := newCopier(t, drv, Options{PTX: fakePTX, GatherChunkBytes: 1 << 20, DescCapacity: 64, ChunkBytes: 16 << 10, MaxDeviceBytes: maxBytes})
	knownHost(t, c, src)
	knownHost(t, c, dst)
	// Scatter src into dev and gather it back into dst, with kernel fills
	// of dev2 beside, many times without retiring.
	h2d := blockSegs(H2D, addr(src), uint64(dev), 24, 4, 64<<10, 2)
	d2h := make([]Segment, len(h2d))
	for i, sg := range h2d {
		d2h[i] = Segment{Dst: addr(dst) + (sg.Src - addr(src)), Src: sg.Dst, Len: sg.Len}
	}
	// 384 fills of 16 KiB: 6 descriptor tables.
	fills := make([]FillSegment, 384)
	for i := range fills {
		fills[i] = FillSegment{Dst: uint64(dev2) + uint64(i)*(16<<10), Len: 16 << 10}
	}
	var tks []Ticket
	for i := range 6 {
		tk, err := c.SubmitScatter(s, g, h2d)
		require.NoError(t, err)
		tks = append(tks, tk)
		tk, err = c.SubmitGather(g, s, d2h)
		require.NoError(t, err)
		tks = append(tks, tk)
		tk, err = c.Fill(s, fills, 0)
		require.NoError(t, err, "batch %d", i)
		tks = append(tks, tk)
		require.LessOrEqual(t, c.DeviceBytes(), maxBytes)
	}
	require.NoError(t, drv.StreamSynchronize(s))
	for _, tk := range tks {
		require.NoError(t, c.Retire(tk))
	}
	require.Equal(t, -1, firstDiff(src, dst))
	require.LessOrEqual(t, c.PeakDeviceBytes(), maxBytes)
	require.LessOrEqual(t, drv.PeakDeviceBytes()-base, uint64(maxBytes))
	require.Positive(t, c.BudgetWaits())
	c.mu.Lock()
	require.LessOrEqual(t, len(c.stagingAll), 2, "the ring of 4 took the 2 chunks the bound holds")
	c.mu.Unlock()

	// 70000 fills: 1094 tables of 2 KiB, more than the whole bound.
	many := make([]FillSegment, 70000)
	for i := range many {
		many[i] = FillSegment{Dst: uint64(dev2) + uint64(i)*16, Len: 16}
	}
	_, err := c.Fill(s, many, 0)
	require.ErrorIs(t, err, ErrDeviceBudget)
	require.ErrorContains(t, err, "over MaxDeviceBytes")
	require.LessOrEqual(t, c.PeakDeviceBytes(), maxBytes)
}

func TestDeviceBudgetOptions(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{})
	_, err := New(drv, 0, Options{PTX: fakePTX, MaxDeviceBytes: -1})
	require.ErrorIs(t, err, ErrInvalidOption)
	min := MinDeviceBytes(Options{})
	require.EqualValues(t, DefaultDescCapacity*descSize+DefaultGatherChunk, min)
	_, err = New(drv, 0, Options{PTX: fakePTX, MaxDeviceBytes: min - 1})
	require.ErrorIs(t, err, ErrInvalidOption)
	require.ErrorContains(t, err, "minimum")
	// New allocates at most the DescBuffers the bound holds (5 of 8).
	c := newCopier(t, drv, Options{PTX: fakePTX, MaxDeviceBytes: min, DescBuffers: 8})
	require.EqualValues(t, min, c.DeviceBytes())
	// Calibrate's 32 MiB buffer does not fit beside one staged copy.
	_, err = c.Calibrate(newStream(t, drv))
	require.ErrorIs(t, err, ErrDeviceBudget)
	require.Zero(t, drv.PeakDeviceBytes()-uint64(c.PeakDeviceBytes()))
}

// Prewarm allocates tables and staging chunks ahead, so that the first
// gathered copy allocates no device memory, and stops quietly at the bound
// (KeepIdle's shares included).
func TestPrewarmFake(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{DeviceMemory: 4 << 30})
	g, s := newStream(t, drv), newStream(t, drv)
	const n = 8 << 20
	src, dst, dev := testBuffers(t, drv, n)
	c := newCopier(t, drv, Options{PTX: fakePTX})
	knownHost(t, c, dst)
	base := c.DeviceBytes()
	require.NoError(t, c.Prewarm(2, 1))
	require.EqualValues(t, 2*c.descBytes()+int64(DefaultGatherRing)*DefaultGatherChunk, c.DeviceBytes()-base)
	allocs := drv.Calls(cuda.OpMemAlloc)
	require.NoError(t, drv.Memcpy(dev, cuda.DevicePtr(addr(src)), n))
	segs := blockSegs(D2H, addr(dst), uint64(dev), 8, 8, 128<<10, 2)
	tk, err := c.SubmitGather(g, s, segs)
	require.NoError(t, err)
	require.NoError(t, drv.StreamSynchronize(s))
	require.NoError(t, c.Retire(tk))
	require.Equal(t, allocs, drv.Calls(cuda.OpMemAlloc), "the first gathered copy allocated device memory after Prewarm")
	// At the bound Prewarm stops without an error.
	require.True(t, c.KeepIdle())
	require.NoError(t, c.Prewarm(1000, 1000))
	require.LessOrEqual(t, c.DeviceBytes(), c.MaxDeviceBytes())
	require.LessOrEqual(t, int64(len(c.all))*c.descBytes(), c.tableCap)
	require.NoError(t, c.Close())
}

// KeepIdle after Prewarm on a small bound frees the idle tables and chunks
// beyond the shares, so later copies fit them (found in review: every copy
// failed with ErrDeviceBudget once the tables exceeded their share).
func TestKeepIdleTrimsExcessFake(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{DeviceMemory: 4 << 30})
	g, s := newStream(t, drv), newStream(t, drv)
	const n = 8 << 20
	src, dst, dev := testBuffers(t, drv, n)
	c := newCopier(t, drv, Options{PTX: fakePTX, MaxDeviceBytes: 16 << 20})
	knownHost(t, c, dst)
	require.NoError(t, c.Prewarm(8, 1))
	require.True(t, c.KeepIdle())
	require.LessOrEqual(t, int64(len(c.all))*c.descBytes(), c.tableCap)
	require.LessOrEqual(t, c.DeviceBytes(), c.MaxDeviceBytes())
	require.NoError(t, drv.Memcpy(dev, cuda.DevicePtr(addr(src)), n))
	segs := blockSegs(D2H, addr(dst), uint64(dev), 8, 8, 128<<10, 3)
	for range 3 {
		tk, err := c.SubmitGather(g, s, segs)
		require.NoError(t, err)
		require.NoError(t, drv.StreamSynchronize(s))
		require.NoError(t, c.Retire(tk))
		tk, err = c.Submit(s, D2H, segs)
		require.NoError(t, err)
		require.NoError(t, drv.StreamSynchronize(s))
		require.NoError(t, c.Retire(tk))
	}
	require.NoError(t, c.Close())
}
