package cudacopy

import (
	"bytes"
	"crypto/rand"
	mrand "math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
)

// gatherRoundTrip fills the device side of l with random data (through
// host → device copies), gathers it back to poisoned host memory with
// SubmitGather on g then s, and checks every byte.
func gatherRoundTrip(t *testing.T, drv cuda.Driver, c *Copier, g, s cuda.Stream, l layout, seed uint64) {
	t.Helper()
	n := l.bytes()
	src, dst, dev := testBuffers(t, drv, n)
	knownHost(t, c, dst)
	require.NoError(t, drv.Memcpy(dev, cuda.DevicePtr(addr(src)), n))
	// The device data is the host data through the same permutation: load
	// it with the layout's H2D segments first (on g, so the gather, also on
	// g, is ordered after it).
	h2d, d2h := l.segments(addr(src), uint64(dev), addr(dst), mrand.New(mrand.NewPCG(seed, 7)))
	require.NoError(t, drv.MemsetD8(dev, 0xDD, n))
	require.NoError(t, drv.CtxSynchronize())
	run(t, drv, c, g, H2D, h2d)
	tk, err := c.SubmitGather(g, s, d2h)
	require.NoError(t, err)
	waitRetire(t, drv, c, s, tk)
	if i := firstDiff(src, dst); i >= 0 {
		t.Fatalf("%v gathered: byte %d differs: sent %#x, got %#x", l, i, src[i], dst[i])
	}
}

// knownHost tells c about the registered buffer b for the test's duration,
// so that staged copies merge host runs inside it.
func knownHost(t *testing.T, c *Copier, b []byte) {
	t.Helper()
	require.NoError(t, c.AddHostRange(uintptr(addr(b)), uint64(len(b))))
	t.Cleanup(func() { require.NoError(t, c.RemoveHostRange(uintptr(addr(b)))) })
}

func TestSubmitGatherFake(t *testing.T) {
	for _, noBatch := range []bool{false, true} {
		drv := cudatest.OpenFake(t, cudafake.Options{MaxDelay: 50_000, NoMemcpyBatch: noBatch})
		g, s := newStream(t, drv), newStream(t, drv)
		// 1 MiB chunks: blocks of 12 × 48 KiB straddle chunk boundaries, so
		// one run becomes two DMAs.
		c := newCopier(t, drv, Options{PTX: fakePTX, GatherChunkBytes: 1 << 20, DescCapacity: 5, BatchMax: 3})
		for i, l := range []layout{layerSeparate(9, 6, 48<<10), layerSeparate(40, 4, 4<<10), layerSeparate(3, 1, 512<<10)} {
			gatherRoundTrip(t, drv, c, g, s, l, uint64(i))
		}
		// One staging chunk for a 5 MiB batch: every gather after the first
		// waits for the previous chunk's copy out.
		one := newCopier(t, drv, Options{PTX: fakePTX, GatherChunkBytes: 1 << 20, GatherRing: 1})
		gatherRoundTrip(t, drv, one, g, s, layerSeparate(9, 6, 48<<10), 5)
		allocs := drv.Calls(cuda.OpMemAlloc)
		gatherRoundTrip(t, drv, c, g, s, layerSeparate(9, 6, 48<<10), 9)
		require.Equal(t, allocs+1, drv.Calls(cuda.OpMemAlloc), "staging reused after Retire (only the test's device buffer is new)")
		// The chunks of a batch share descriptor buffers: 6 chunks' 108
		// descriptors fit the one buffer New allocated.
		single := newCopier(t, drv, Options{PTX: fakePTX, GatherChunkBytes: 1 << 20, DescBuffers: 1})
		hostAllocs := drv.Calls(cuda.OpMemHostAlloc)
		gatherRoundTrip(t, drv, single, g, s, layerSeparate(9, 6, 48<<10), 10)
		require.Equal(t, hostAllocs, drv.Calls(cuda.OpMemHostAlloc), "no descriptor buffer beyond the first")
	}
}

// The gather reads the device only after what g was made to wait for: a
// producer on a third stream writes the data after a spin; the store's
// streams wait for its event, as cudadev.CUDA does for a store.
func TestSubmitGatherWaitsForProducerFake(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{MaxDelay: 20_000})
	p, g, s := newStream(t, drv), newStream(t, drv), newStream(t, drv)
	c := newCopier(t, drv, Options{PTX: fakePTX, GatherChunkBytes: 1 << 20})
	l := layerSeparate(16, 4, 8<<10)
	n := l.bytes()
	dev := devMem(t, drv, n)
	dst := hostMem(t, drv, n)
	poison(dst, 0xEE)
	require.NoError(t, drv.MemsetD8(dev, 0xDD, n))
	require.NoError(t, drv.CtxSynchronize())
	fill, err := c.Fill(p, []FillSegment{{Dst: uint64(dev), Len: n}}, 1<<20)
	require.NoError(t, err)
	ev, err := drv.EventCreate(cuda.EventDisableTiming)
	require.NoError(t, err)
	defer func() { require.NoError(t, drv.EventDestroy(ev)) }()
	require.NoError(t, drv.EventRecord(ev, p))
	require.NoError(t, drv.StreamWaitEvent(g, ev, cuda.EventWaitDefault))
	require.NoError(t, drv.StreamWaitEvent(s, ev, cuda.EventWaitDefault))
	_, d2h := l.segments(addr(dst), uint64(dev), addr(dst), mrand.New(mrand.NewPCG(3, 3)))
	tk, err := c.SubmitGather(g, s, d2h)
	require.NoError(t, err)
	waitRetire(t, drv, c, s, tk)
	require.NoError(t, drv.StreamSynchronize(p))
	require.NoError(t, c.Retire(fill))
	want := make([]byte, n)
	FillPattern(0, want)
	for _, sg := range d2h {
		off := sg.Src - uint64(dev)
		h := sg.Dst - addr(dst)
		require.Equal(t, want[off:off+sg.Len], dst[h:h+sg.Len], "segment at device offset %d", off)
	}
}

func TestGatherable(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{})
	c := newCopier(t, drv, Options{PTX: fakePTX, GatherChunkBytes: 1 << 20})
	_, blocks := layerSeparate(8, 8, 16<<10).segments(1<<20, 1<<40, 1<<30, mrand.New(mrand.NewPCG(1, 1)))
	require.False(t, c.Gatherable(blocks), "host runs outside every known range")
	require.NoError(t, c.AddHostRange(1<<30, 64<<20))
	require.True(t, c.Gatherable(blocks), "16 segments of 16 KiB per 256 KiB host run")
	_, scattered := crossLayer(64, 16<<10).segments(1<<20, 1<<40, 1<<30, mrand.New(mrand.NewPCG(1, 1)))
	require.False(t, c.Gatherable(scattered), "runs of one 16 KiB segment")
	_, short := layerSeparate(8, 2, 16<<10).segments(1<<20, 1<<40, 1<<30, mrand.New(mrand.NewPCG(1, 1)))
	require.False(t, c.Gatherable(short), "64 KiB runs")
	_, big := layerSeparate(2, 1, 2<<20).segments(1<<20, 1<<40, 1<<30, mrand.New(mrand.NewPCG(1, 1)))
	require.False(t, c.Gatherable(big), "segments larger than a chunk")
	mis := append([]Segment(nil), blocks...)
	mis[3].Len -= 8
	mis[4].Dst -= 8
	require.False(t, c.Gatherable(mis), "misaligned")
	require.False(t, c.Gatherable(blocks[:1]))

	forced := newCopier(t, drv, Options{PTX: fakePTX, Method: MethodKernel})
	require.False(t, forced.Gatherable(blocks), "a forced method")
	off := newCopier(t, drv, Options{PTX: fakePTX, NoGather: true})
	require.False(t, off.Gatherable(blocks))
	_, err := off.SubmitGather(1, 2, blocks)
	require.ErrorIs(t, err, ErrUnavailable)
	// A calibration where the batch API beats the kernel at this size:
	// the DMA method is taken directly, no gather.
	dma := newCopier(t, drv, Options{PTX: fakePTX, Calibration: &Calibration{Entries: []Measurement{
		{Dir: D2H, Method: MethodBatch, SegBytes: 16 << 10, GBps: 50}, {Dir: D2H, Method: MethodKernel, SegBytes: 16 << 10, GBps: 40}}}})
	require.False(t, dma.Gatherable(blocks))

	_, err = c.SubmitGather(1, 2, big)
	require.ErrorIs(t, err, ErrInvalidSegment)
	require.ErrorContains(t, err, "larger than a staging chunk")
	_, err = New(drv, 0, Options{PTX: fakePTX, GatherChunkBytes: 4096})
	require.ErrorIs(t, err, ErrInvalidOption)
}

// Failures part-way, in either direction, leave nothing that a later call
// could disturb, and nothing leaks (openFake checks that every allocation is
// freed at Close).
func TestStagedFailuresFake(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{})
	g, s := newStream(t, drv), newStream(t, drv)
	l := layerSeparate(8, 4, 64<<10)
	n := l.bytes()
	dev := devMem(t, drv, n)
	host := hostMem(t, drv, n)
	h2d, d2h := l.segments(addr(host), uint64(dev), addr(host), mrand.New(mrand.NewPCG(5, 5)))
	for _, dir := range []Path{D2H, H2D} {
		// A copier of its own per direction: nothing pooled yet, so every
		// allocation below is reached.
		c := newCopier(t, drv, Options{PTX: fakePTX, GatherChunkBytes: 1 << 20, GatherRing: 1})
		knownHost(t, c, host)
		submit := func() (Ticket, error) {
			if dir == D2H {
				return c.SubmitGather(g, s, d2h)
			}
			return c.SubmitScatter(s, g, h2d)
		}
		for _, op := range []string{cuda.OpMemAlloc, cuda.OpEventCreate, cuda.OpLaunchKernel, cuda.OpEventRecord, cuda.OpStreamWaitEvent, cuda.OpMemcpyBatchAsync} {
			drv.FailAt(op, drv.Calls(op)+1, cuda.ErrorOutOfMemory)
			_, err := submit()
			require.Error(t, err, "%v %s", dir, op)
			require.True(t, cuda.IsCode(err, cuda.ErrorOutOfMemory), "%v %s: %v", dir, op, err)
		}
		// Still works afterwards.
		tk, err := submit()
		require.NoError(t, err)
		waitRetire(t, drv, c, s, tk)
	}
}

// batchChecker fails a batch copy whose source crosses the end of its
// device allocation (the H200's driver refuses one with
// CUDA_ERROR_INVALID_VALUE).
type batchChecker struct {
	cuda.Driver
	t *testing.T
}

func (b *batchChecker) MemcpyBatchAsync(copies []cuda.BatchCopy, s cuda.Stream) error {
	for i, c := range copies {
		base, size, err := b.Driver.MemGetAddressRange(c.Src)
		require.NoError(b.t, err, "copy %d", i)
		require.LessOrEqual(b.t, uint64(c.Src)+c.Size, uint64(base)+size, "copy %d of %d bytes crosses its source allocation", i, c.Size)
	}
	return b.Driver.MemcpyBatchAsync(copies, s)
}

// Host-adjacent blocks that straddle two staging chunks go out as one DMA
// per chunk, even when the chunks' addresses are adjacent.
func TestSubmitGatherPiecesStayInChunksFake(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{})
	chk := &batchChecker{Driver: drv, t: t}
	g, s := newStream(t, drv), newStream(t, drv)
	c := newCopier(t, chk, Options{PTX: fakePTX, GatherChunkBytes: 1 << 20})
	const seg, per = 16 << 10, 24 // 384 KiB blocks: the third straddles chunks
	n := uint64(seg * per * 6)
	src, dst := hostMem(t, drv, n), hostMem(t, drv, n)
	dev := devMem(t, drv, n)
	_, _ = rand.Read(src)
	require.NoError(t, drv.Memcpy(dev, cuda.DevicePtr(addr(src)), n))
	// Blocks in host order: every run continues the previous one.
	var d2h []Segment
	for b := range 6 {
		for k := range per {
			off := uint64((b*per + k) * seg)
			d2h = append(d2h, Segment{Dst: addr(dst) + off, Src: uint64(dev) + off, Len: seg})
		}
	}
	tk, err := c.SubmitGather(g, s, d2h)
	require.NoError(t, err)
	waitRetire(t, drv, c, s, tk)
	require.Equal(t, src, dst)
}

// packStaged never merges a run across two chunks, even adjacent ones, and
// merges host-contiguous segments within a chunk.
func TestPackGather(t *testing.T) {
	const chunk = 1 << 20
	staging := []cuda.DevicePtr{0x10000000, 0x10000000 + chunk, 0x10000000 + 2*chunk}
	var segs []Segment
	for i := range 10 {
		segs = append(segs, Segment{Dst: 0x7000000 + uint64(i)*256<<10, Src: 0x90000000 + uint64(9-i)*256<<10, Len: 256 << 10})
	}
	hosts := &hostTable{ranges: []hostRange{{base: 0x7000000, size: 16 << 20, dev: 0x7000000}}}
	gather, pieces := packStaged(D2H, segs, chunkParts(segs, chunk), staging, hosts, 0, 0, nil)
	require.Len(t, gather, 10)
	require.Equal(t, []gatherPiece{
		{host: 0x7000000, staging: 0x10000000, len: 4 * 256 << 10, chunk: 0},
		{host: 0x7000000 + 4*256<<10, staging: 0x10000000 + chunk, len: 4 * 256 << 10, chunk: 1},
		{host: 0x7000000 + 8*256<<10, staging: 0x10000000 + 2*chunk, len: 2 * 256 << 10, chunk: 2},
	}, pieces)
	for i, g := range gather {
		require.Equal(t, segs[i].Src, g.Src)
		require.Equal(t, uint64(staging[i/4])+uint64(i%4)*256<<10, g.Dst)
	}
	// A gap in the host addresses starts a new piece in the same chunk.
	segs[2].Dst += 4096
	segs[3].Dst += 4096
	_, pieces = packStaged(D2H, segs[:4], chunkParts(segs[:4], chunk), staging, hosts, 0, 0, nil)
	require.Len(t, pieces, 2)
	require.Equal(t, uint64(2*256<<10), pieces[0].len)
	require.Equal(t, uint64(2*256<<10), pieces[1].len)
	require.Equal(t, 0, pieces[1].chunk)

	// H2D: the host side is Src, and the kernel copies staging → device.
	loads := make([]Segment, 3)
	for i := range loads {
		loads[i] = Segment{Dst: 0x90000000 + uint64(2-i)*256<<10, Src: 0x7000000 + uint64(i)*256<<10, Len: 256 << 10}
	}
	scatter, pieces := packStaged(H2D, loads, chunkParts(loads, chunk), staging[:1], hosts, 0, 0, nil)
	require.Equal(t, []gatherPiece{{host: 0x7000000, staging: 0x10000000, len: 3 * 256 << 10}}, pieces)
	for i, g := range scatter {
		require.Equal(t, Segment{Dst: loads[i].Dst, Src: 0x10000000 + uint64(i)*256<<10, Len: 256 << 10}, g)
	}
	// Two registrations meeting between the second and third segment: no
	// DMA spans them; outside every range, each segment goes alone.
	two := &hostTable{ranges: []hostRange{{base: 0x7000000, size: 512 << 10, dev: 0x7000000}, {base: 0x7000000 + 512<<10, size: 16 << 20, dev: 0x7000000 + 512<<10}}}
	_, pieces = packStaged(H2D, loads, chunkParts(loads, chunk), staging[:1], two, 0, 0, nil)
	require.Len(t, pieces, 2)
	require.Equal(t, []uint64{512 << 10, 256 << 10}, []uint64{pieces[0].len, pieces[1].len})
	_, pieces = packStaged(H2D, loads, chunkParts(loads, chunk), staging[:1], &hostTable{}, 0, 0, nil)
	require.Len(t, pieces, 3)
}

// scatterRoundTrip loads l's blocks from random host data with
// SubmitScatter on s then g into a poisoned device buffer, copies the
// device buffer back and checks every byte against the same permutation.
func scatterRoundTrip(t *testing.T, drv cuda.Driver, c *Copier, s, g cuda.Stream, l layout, seed uint64) {
	t.Helper()
	n := l.bytes()
	src, back, dev := testBuffers(t, drv, n)
	knownHost(t, c, src)
	require.NoError(t, drv.MemsetD8(dev, 0xDD, n))
	require.NoError(t, drv.CtxSynchronize())
	h2d, _ := l.segments(addr(src), uint64(dev), addr(back), mrand.New(mrand.NewPCG(seed, 9)))
	tk, err := c.SubmitScatter(s, g, h2d)
	require.NoError(t, err)
	waitRetire(t, drv, c, s, tk)
	require.NoError(t, drv.Memcpy(cuda.DevicePtr(addr(back)), dev, n))
	for i, sg := range h2d {
		h, d := sg.Src-addr(src), sg.Dst-uint64(dev)
		if !bytes.Equal(src[h:h+sg.Len], back[d:d+sg.Len]) {
			t.Fatalf("%v scattered: segment %d (host offset %d, device offset %d) differs", l, i, h, d)
		}
	}
}

func TestSubmitScatterFake(t *testing.T) {
	for _, noBatch := range []bool{false, true} {
		drv := cudatest.OpenFake(t, cudafake.Options{MaxDelay: 50_000, NoMemcpyBatch: noBatch})
		s, g := newStream(t, drv), newStream(t, drv)
		c := newCopier(t, drv, Options{PTX: fakePTX, GatherChunkBytes: 1 << 20, DescCapacity: 5, BatchMax: 3})
		for i, l := range []layout{layerSeparate(9, 6, 48<<10), layerSeparate(40, 4, 4<<10), layerSeparate(3, 1, 512<<10)} {
			scatterRoundTrip(t, drv, c, s, g, l, uint64(i))
		}
		// One staging chunk for a 5 MiB batch: every load into it after
		// the first waits for the previous chunk's scatter.
		one := newCopier(t, drv, Options{PTX: fakePTX, GatherChunkBytes: 1 << 20, GatherRing: 1})
		scatterRoundTrip(t, drv, one, s, g, layerSeparate(9, 6, 48<<10), 5)
	}
}

func TestScatterable(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{})
	c := newCopier(t, drv, Options{PTX: fakePTX, GatherChunkBytes: 1 << 20})
	require.NoError(t, c.AddHostRange(1<<20, 64<<20))
	require.NoError(t, c.AddHostRange(1<<30, 64<<20))
	blocks, stores := layerSeparate(8, 8, 16<<10).segments(1<<20, 1<<40, 1<<30, mrand.New(mrand.NewPCG(1, 1)))
	require.True(t, c.Scatterable(blocks))
	require.False(t, c.Scatterable(stores), "host runs on the Dst side are not an H2D batch's")
	_, scattered := crossLayer(64, 16<<10).segments(1<<20, 1<<40, 1<<30, mrand.New(mrand.NewPCG(1, 1)))
	require.False(t, c.Scatterable(scattered))
}

// streamLog records the stream of every async copy, event wait and kernel
// launch, in order.
type streamLog struct {
	cuda.Driver
	ops []streamOp
}

type streamOp struct {
	op string
	s  cuda.Stream
}

func (r *streamLog) MemcpyAsync(dst, src cuda.DevicePtr, n uint64, s cuda.Stream) error {
	r.ops = append(r.ops, streamOp{cuda.OpMemcpyAsync, s})
	return r.Driver.MemcpyAsync(dst, src, n, s)
}

func (r *streamLog) StreamWaitEvent(s cuda.Stream, e cuda.Event, flags uint32) error {
	r.ops = append(r.ops, streamOp{cuda.OpStreamWaitEvent, s})
	return r.Driver.StreamWaitEvent(s, e, flags)
}

func (r *streamLog) LaunchKernel(f cuda.Function, grid, block cuda.Dim3, shm uint32, s cuda.Stream, args ...[]byte) error {
	r.ops = append(r.ops, streamOp{cuda.OpLaunchKernel, s})
	return r.Driver.LaunchKernel(f, grid, block, shm, s, args...)
}

// A staged batch uploads its descriptors on the kernel's stream before
// anything else there, one copy per descriptor buffer: an upload per chunk,
// behind the wait for the chunk's load, queued on the host-to-device copy
// engine behind the next chunks' loads and held each scatter back. Where
// the device takes host pointers as they are, a scatter uploads nothing:
// its kernels read the pinned tables.
func TestStagedUploadsDescriptorsFirstFake(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{})
	rec := &streamLog{Driver: drv}
	s, g := newStream(t, drv), newStream(t, drv)
	// 768 segments of 4 KiB in 1 MiB chunks (3 chunks of 256), 300
	// descriptors per buffer: 3 buffers; chunks 1 and 2 each span two.
	c := newCopier(t, rec, Options{PTX: fakePTX, GatherChunkBytes: 1 << 20, DescCapacity: 300})
	require.True(t, c.Capabilities().HostPointerIdentity)
	l := layerSeparate(96, 4, 4<<10)
	for _, dir := range []Path{H2D, D2H} {
		rec.ops = nil
		if dir == H2D {
			scatterRoundTrip(t, rec, c, s, g, l, 1)
		} else {
			gatherRoundTrip(t, rec, c, g, s, l, 1)
		}
		var onG []string
		for _, o := range rec.ops {
			if o.s == g {
				onG = append(onG, o.op)
			}
		}
		if dir == D2H {
			// gatherRoundTrip first loads the device data with Submit on g:
			// per buffer, a wait for its upload (on the Copier's upload
			// stream) and a launch.
			require.Equal(t, []string{cuda.OpStreamWaitEvent, cuda.OpLaunchKernel, cuda.OpStreamWaitEvent, cuda.OpLaunchKernel, cuda.OpStreamWaitEvent, cuda.OpLaunchKernel}, onG[:6])
			onG = onG[6:]
		}
		uploads := 0
		for uploads < len(onG) && onG[uploads] == cuda.OpMemcpyAsync {
			uploads++
		}
		want := 3
		if dir == H2D {
			want = 0
		}
		require.Equal(t, want, uploads, "%v: %v", dir, onG)
		require.NotContains(t, onG[uploads:], cuda.OpMemcpyAsync, "%v: %v", dir, onG)
		// One launch per chunk and buffer: 1 + 2 + 2.
		launches := 0
		for _, op := range onG[uploads:] {
			if op == cuda.OpLaunchKernel {
				launches++
			}
		}
		require.Equal(t, 5, launches, "%v: %v", dir, onG)
	}
}

// A staged load that fails after some scatters were launched leaves s
// waiting for them: once s has drained, nothing of the load still runs on
// g (the engine reports the failure by recording an event on s, and the
// device blocks must not change after it). Each failing call is one of the
// pipeline's later ones: a chunk's event wait or batch copy, or the final
// join.
func TestStagedLoadFailureJoinsScattersFake(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{MaxDelay: 2 * time.Millisecond})
	g, s := newStream(t, drv), newStream(t, drv)
	l := layerSeparate(12, 4, 64<<10) // 3 MiB: three 1 MiB chunks
	n := l.bytes()
	dev := devMem(t, drv, n)
	host := hostMem(t, drv, n)
	h2d, _ := l.segments(addr(host), uint64(dev), addr(host), mrand.New(mrand.NewPCG(6, 6)))
	c := newCopier(t, drv, Options{PTX: fakePTX, GatherChunkBytes: 1 << 20})
	knownHost(t, c, host)
	for _, tc := range []struct {
		op string
		at int // the op's call within SubmitScatter, from 1
	}{
		{cuda.OpStreamWaitEvent, 4}, // chunk 2's join of its load, after chunk 1's scatter
		{cuda.OpMemcpyBatchAsync, 3},
		{cuda.OpStreamWaitEvent, 6}, // the final join of the last scatter
	} {
		drv.FailAt(tc.op, drv.Calls(tc.op)+tc.at, cuda.ErrorInvalidValue)
		before := drv.Calls(cuda.OpLaunchKernel)
		_, err := c.SubmitScatter(s, g, h2d)
		require.Error(t, err, "%s #%d", tc.op, tc.at)
		require.Greater(t, drv.Calls(cuda.OpLaunchKernel), before, "%s #%d: a scatter was launched before the failure", tc.op, tc.at)
		require.NoError(t, drv.StreamSynchronize(s))
		idle, err := drv.StreamQuery(g)
		require.NoError(t, err)
		require.True(t, idle, "%s #%d: a scatter still runs after s drained", tc.op, tc.at)
	}
}
