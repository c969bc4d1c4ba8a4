package cudacopy

import (
	"crypto/rand"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
)

// no2D hides Desc2DKernel, as a PTX image built before 2-D descriptors
// would: the Copier then sends one descriptor per row.
type no2D struct{ cuda.Driver }

func (d no2D) ModuleGetFunction(m cuda.Module, name string) (cuda.Function, error) {
	if name == Desc2DKernel {
		return 0, cuda.NewError(cuda.OpModuleGetFunction, cuda.ErrorNotFound)
	}
	return d.Driver.ModuleGetFunction(m, name)
}

// headCase is a token-major KV block on the device and its head-major copy
// on the host: blocks × tokens × heads × row bytes. A load moves heads
// [first, first+count) of each block from the host into the poisoned
// device, a store moves them back into a poisoned host buffer.
type headCase struct {
	blocks, tokens, heads, row int
	first, count               int
}

func (h headCase) String() string {
	return fmt.Sprintf("%d blocks × %d tokens × %d heads × %d B, heads [%d, %d)", h.blocks, h.tokens, h.heads, h.row, h.first, h.first+h.count)
}

func (h headCase) bytes() uint64 { return uint64(h.blocks * h.tokens * h.heads * h.row) }

// segments returns the 2-D segments moving the case's heads: device
// (token-major) at dev, host (head-major) at host; h2d gives the load's,
// otherwise the store's.
func (h headCase) segments(dev, host uint64, h2d bool) []Segment2D {
	var segs []Segment2D
	headBytes := uint64(h.tokens * h.row)
	for b := 0; b < h.blocks; b++ {
		blk := uint64(b) * uint64(h.tokens*h.heads*h.row)
		for x := h.first; x < h.first+h.count; x++ {
			d := dev + blk + uint64(x*h.row)
			o := host + blk + uint64(x)*headBytes
			s := Segment2D{Rows: uint64(h.tokens), RowLen: uint64(h.row)}
			if h2d {
				s.Src, s.SrcPitch, s.Dst, s.DstPitch = o, uint64(h.row), d, uint64(h.heads*h.row)
			} else {
				s.Src, s.SrcPitch, s.Dst, s.DstPitch = d, uint64(h.heads*h.row), o, uint64(h.row)
			}
			segs = append(segs, s)
		}
	}
	return segs
}

// devIndex is the byte of (block, token, head, byte) in the token-major
// device buffer; hostIndex in the head-major host buffer.
func (h headCase) devIndex(b, tok, x, e int) int {
	return ((b*h.tokens+tok)*h.heads+x)*h.row + e
}
func (h headCase) hostIndex(b, tok, x, e int) int {
	return ((b*h.heads+x)*h.tokens+tok)*h.row + e
}

// submitHeads is Submit2D, or with prepare Prepare2D (on another
// goroutine, as the transfer package's part builders call it) then
// SubmitPrepared.
func submitHeads(t *testing.T, c *Copier, s cuda.Stream, dir Path, segs []Segment2D, prepare bool) Ticket {
	t.Helper()
	if !prepare {
		tk, err := c.Submit2D(s, dir, segs)
		require.NoError(t, err)
		return tk
	}
	var p Prepared
	done := make(chan error)
	go func() { done <- c.Prepare2D(dir, segs, &p) }()
	require.NoError(t, <-done)
	tk, err := c.SubmitPrepared(s, &p)
	require.NoError(t, err)
	return tk
}

// checkHeads runs the case through c: load the heads into the device
// poisoned with 0xDD, read the whole device back, check each head byte and
// that every other byte is still poison; store them into a host buffer
// poisoned with 0xEE and check it the same way.
func checkHeads(t *testing.T, drv cuda.Driver, c *Copier, s cuda.Stream, h headCase, prepare bool) {
	t.Helper()
	n := h.bytes()
	src, dst := hostMem(t, drv, n), hostMem(t, drv, n)
	devCopy := hostMem(t, drv, n)
	dev := devMem(t, drv, n)
	_, _ = rand.Read(src)
	poison(dst, 0xEE)
	require.NoError(t, drv.MemsetD8(dev, 0xDD, n))
	require.NoError(t, drv.CtxSynchronize())
	tk := submitHeads(t, c, s, H2D, h.segments(uint64(dev), addr(src), true), prepare)
	waitRetire(t, drv, c, s, tk)
	require.NoError(t, drv.Memcpy(cuda.DevicePtr(addr(devCopy)), dev, n))
	tk = submitHeads(t, c, s, D2H, h.segments(uint64(dev), addr(dst), false), prepare)
	waitRetire(t, drv, c, s, tk)
	for b := 0; b < h.blocks; b++ {
		for tok := 0; tok < h.tokens; tok++ {
			for x := 0; x < h.heads; x++ {
				in := x >= h.first && x < h.first+h.count
				for e := 0; e < h.row; e++ {
					di, hi := h.devIndex(b, tok, x, e), h.hostIndex(b, tok, x, e)
					wantDev, wantHost := byte(0xDD), byte(0xEE)
					if in {
						wantDev, wantHost = src[hi], src[hi]
					}
					if devCopy[di] != wantDev || dst[hi] != wantHost {
						t.Fatalf("%v via %v (2-D descriptors %v): block %d token %d head %d byte %d: device %#x (want %#x), host %#x (want %#x)",
							h, c.Options().Method, c.Capabilities().Kernel2D, b, tok, x, e, devCopy[di], wantDev, dst[hi], wantHost)
					}
				}
			}
		}
	}
}

// headCases cover 2-D descriptors of several rows, rows of one descriptor
// each (rows over half a chunk), chunks splitting a head, one head per
// rank, and replicated heads.
var headCases = []headCase{
	{blocks: 3, tokens: 16, heads: 8, row: 256, first: 2, count: 4},
	{blocks: 2, tokens: 5, heads: 4, row: 48, first: 0, count: 4},
	{blocks: 2, tokens: 3, heads: 2, row: 768, first: 1, count: 1},
	{blocks: 4, tokens: 16, heads: 1, row: 1152, first: 0, count: 1},
	{blocks: 1, tokens: 64, heads: 8, row: 16, first: 7, count: 1},
}

func TestSubmit2DFake(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{MaxDelay: 20_000})
	s := newStream(t, drv)
	for _, hide := range []bool{false, true} {
		var d cuda.Driver = drv
		if hide {
			d = no2D{drv}
		}
		for _, m := range []Method{MethodMemcpy, MethodBatch, MethodKernel, MethodAuto} {
			// Small chunks and descriptor buffers: batches span launches.
			c := newCopier(t, d, Options{Method: m, PTX: fakePTX, DescCapacity: 7, ChunkBytes: 1024, BatchMax: 5})
			require.Equal(t, !hide, c.Capabilities().Kernel2D)
			for i, h := range headCases {
				checkHeads(t, drv, c, s, h, i%2 == 1)
			}
		}
	}
}

// The chunker's descriptors: 2-D ones of a chunk of rows with the kernel's
// encoding, or one per row (in chunks) otherwise; count agrees with next.
func TestChunker2D(t *testing.T) {
	segs := []Segment2D{
		{Src: 0x10000, Dst: 0x90000, Rows: 16, RowLen: 256, SrcPitch: 2048, DstPitch: 256},
		{Src: 0x20000, Dst: 0xA0000, Rows: 3, RowLen: 768, SrcPitch: 1536, DstPitch: 768},
		{Src: 0x30000, Dst: 0xB0000, Rows: 1, RowLen: 64},
	}
	ck := chunker{kind: jobCopy2D, copies2d: segs, desc2d: true, chunk: 1024}
	out := make([]desc, 64)
	n, err := ck.next(out)
	require.NoError(t, err)
	require.Equal(t, ck.count(), n)
	require.True(t, ck.done())
	want := []desc{
		{Src: 0x10000, Dst: 0x90000, Len: 256, Aux: encodeDesc2D(4, 2048, 256)},
		{Src: 0x10000 + 4*2048, Dst: 0x90000 + 4*256, Len: 256, Aux: encodeDesc2D(4, 2048, 256)},
		{Src: 0x10000 + 8*2048, Dst: 0x90000 + 8*256, Len: 256, Aux: encodeDesc2D(4, 2048, 256)},
		{Src: 0x10000 + 12*2048, Dst: 0x90000 + 12*256, Len: 256, Aux: encodeDesc2D(4, 2048, 256)},
		{Src: 0x20000, Dst: 0xA0000, Len: 768},
		{Src: 0x20000 + 1536, Dst: 0xA0000 + 768, Len: 768},
		{Src: 0x20000 + 3072, Dst: 0xA0000 + 1536, Len: 768},
		{Src: 0x30000, Dst: 0xB0000, Len: 64},
	}
	require.Equal(t, want, out[:n])
	require.Equal(t, uint64(4)<<48|128<<24|16, want[0].Aux)
	// Without 2-D descriptors: one per row; with no chunking, a 2-D
	// descriptor holds every row (up to the limit).
	ck = chunker{kind: jobCopy2D, copies2d: segs[:1], chunk: 1024}
	n, err = ck.next(out)
	require.NoError(t, err)
	require.Equal(t, 16, n)
	require.Equal(t, desc{Src: 0x10000 + 2048, Dst: 0x90000 + 256, Len: 256}, out[1])
	ck = chunker{kind: jobCopy2D, copies2d: segs[:1], desc2d: true}
	require.Equal(t, 1, ck.count())
	// Output tables smaller than the batch: resumed where they stopped.
	ck = chunker{kind: jobCopy2D, copies2d: segs, desc2d: true, chunk: 1024}
	var all []desc
	for !ck.done() {
		n, err := ck.next(out[:3])
		require.NoError(t, err)
		all = append(all, out[:n]...)
	}
	require.Equal(t, want, all)
}

func TestSubmit2DValidation(t *testing.T) {
	drv := &launchRecorder{Driver: cudatest.OpenFake(t, cudafake.Options{})}
	c := newCopier(t, drv, Options{Method: MethodKernel, PTX: fakePTX})
	ok := Segment2D{Src: 0x1000, Dst: 0x2000, Rows: 4, RowLen: 32, SrcPitch: 64, DstPitch: 32}
	cases := []struct {
		name string
		segs []Segment2D
		err  error
		msg  string
	}{
		{"empty", nil, ErrInvalidSegment, "empty batch"},
		{"no rows", []Segment2D{{Src: 1, Dst: 2, RowLen: 16}}, ErrInvalidSegment, "0 rows of 16 bytes"},
		{"overlapping rows", []Segment2D{{Src: 0x1000, Dst: 0x2000, Rows: 2, RowLen: 32, SrcPitch: 16, DstPitch: 32}}, ErrInvalidSegment, "smaller than its rows"},
		{"nil", []Segment2D{ok, {Dst: 0x2000, Rows: 1, RowLen: 16}}, ErrInvalidSegment, "segment 1 has a nil src"},
		{"wraps", []Segment2D{{Src: ^uint64(0) - 63, Dst: 0x2000, Rows: 2, RowLen: 16, SrcPitch: 64, DstPitch: 16}}, ErrInvalidSegment, "wraps"},
		{"pitch overflow", []Segment2D{{Src: 0x1000, Dst: 0x2000, Rows: 3, RowLen: 16, SrcPitch: 1 << 63, DstPitch: 16}}, ErrInvalidSegment, "overflow 64 bits"},
		{"misaligned pitch", []Segment2D{{Src: 0x1000, Dst: 0x2000, Rows: 2, RowLen: 32, SrcPitch: 40, DstPitch: 32}}, ErrMisaligned, "pitches 40, 32"},
	}
	for _, tc := range cases {
		_, err := c.Submit2D(1, H2D, tc.segs)
		require.ErrorIs(t, err, tc.err, tc.name)
		require.ErrorContains(t, err, tc.msg, tc.name)
		var p Prepared // Prepare2D validates alike, and leaves nothing to submit
		err = c.Prepare2D(H2D, tc.segs, &p)
		require.ErrorIs(t, err, tc.err, tc.name)
		require.ErrorContains(t, err, tc.msg, tc.name)
		_, err = c.SubmitPrepared(1, &p)
		require.ErrorIs(t, err, ErrInvalidOption, tc.name)
	}
	require.Empty(t, drv.args, "nothing launched")
	_, err := c.Submit2D(1, Path(0), []Segment2D{ok})
	require.ErrorIs(t, err, ErrInvalidOption)
	require.ErrorIs(t, c.Prepare2D(Path(0), []Segment2D{ok}, &Prepared{}), ErrInvalidOption)
	// MethodAuto sends misaligned rows to a DMA method, never the kernel.
	a := newCopier(t, drv, Options{PTX: fakePTX})
	require.NotEqual(t, MethodKernel, a.Choose2D(H2D, []Segment2D{ok, {Src: 0x1000, Dst: 0x2000, Rows: 2, RowLen: 24, SrcPitch: 24, DstPitch: 24}}))
	require.Equal(t, MethodKernel, a.Choose2D(H2D, []Segment2D{ok, ok}))
}

// Steady-state Submit2D and Retire allocate nothing, for every method.
func TestSubmit2DDoesNotAllocate(t *testing.T) {
	if raceEnabled {
		t.Skip("sync.Pool drops items at random under -race")
	}
	h := headCases[0]
	segs := h.segments(0x7000000, 0x100000, true)
	for _, m := range []Method{MethodMemcpy, MethodBatch, MethodKernel, MethodAuto} {
		c, err := New(&nullDriver{}, 0, Options{Method: m, DescCapacity: 128, PTX: fakePTX, BatchMax: 64, Calibration: h200Table()})
		require.NoError(t, err)
		var failed error
		allocs := testing.AllocsPerRun(20, func() {
			tk, err := c.Submit2D(1, H2D, segs)
			failed = errors.Join(failed, err, c.Retire(tk))
		})
		require.NoError(t, failed)
		require.Zero(t, allocs, "method %v", m)
		require.NoError(t, c.Close())
	}
}

// TestGPUStrided copies KV heads between a token-major device buffer and a
// head-major host buffer with every method, with 2-D descriptors and one
// descriptor per row, byte for byte, destinations poisoned (skips without
// a GPU; fails with KVO_REQUIRE_GPU=1). KVO_PTX_FILE gives a PTX image
// built in the same run (see gpuOpts); the log says whether the image has
// 2-D descriptors.
func TestGPUStrided(t *testing.T) {
	g := cudatest.Open(t)
	s := newStream(t, g.Drv)
	cases := append([]headCase{
		// Llama-3-8B-like: 8 KV heads of 128 bf16, 16 tokens; TP=2 rank 1.
		{blocks: 64, tokens: 16, heads: 8, row: 256, first: 4, count: 4},
		// 70B on TP=8 loaded by TP=4: 2 of a rank's heads, rows of 256 B.
		{blocks: 32, tokens: 16, heads: 2, row: 256, first: 1, count: 1},
		// MLA-like latent rows of 1152 B, one head.
		{blocks: 16, tokens: 64, heads: 1, row: 1152, first: 0, count: 1},
	}, headCases...)
	methods := []Method{MethodMemcpy, MethodKernel, MethodAuto}
	if g.Drv.HasMemcpyBatch() {
		methods = append(methods, MethodBatch)
	}
	for _, hide := range []bool{false, true} {
		var d cuda.Driver = g.Drv
		if hide {
			d = no2D{g.Drv}
		}
		for _, m := range methods {
			c := newCopier(t, d, gpuOpts(t, Options{Method: m}))
			t.Logf("method %v: kernel %v, 2-D descriptors %v", m, c.Capabilities().Kernel, c.Capabilities().Kernel2D)
			for _, h := range cases {
				checkHeads(t, g.Drv, c, s, h, false)
				checkHeads(t, g.Drv, c, s, h, true)
			}
		}
	}
}
