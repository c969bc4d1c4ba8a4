package cudacopy

import (
	"crypto/rand"
	"errors"
	mrand "math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
)

// noTemplate hides the template kernels, as a PTX image built before them
// would.
type noTemplate struct{ cuda.Driver }

func (d noTemplate) ModuleGetFunction(m cuda.Module, name string) (cuda.Function, error) {
	if name == TemplateKernel || name == TemplateProbeKernel {
		return 0, cuda.NewError(cuda.OpModuleGetFunction, cuda.ErrorNotFound)
	}
	return d.Driver.ModuleGetFunction(m, name)
}

// pieces returns the case's template: heads [first, first+count) of a
// token-major device block (block id's at dev + id × the block's bytes)
// to or from a head-major host block.
func (h headCase) pieces(dev uint64) []TemplatePiece {
	blk := uint64(h.tokens * h.heads * h.row)
	var ps []TemplatePiece
	for x := h.first; x < h.first+h.count; x++ {
		ps = append(ps, TemplatePiece{
			Dev: dev + uint64(x*h.row), DevStride: blk, HostOff: uint64(x * h.tokens * h.row),
			Rows: uint64(h.tokens), RowLen: uint64(h.row), DevPitch: uint64(h.heads * h.row), HostPitch: uint64(h.row),
		})
	}
	return ps
}

// checkTemplate is checkHeads through template launches, with device
// block id b held in host block perm[b]: load the heads into the poisoned
// device, store them into a poisoned host buffer, check every byte.
// Where the Copier must translate host pointers, the host buffers are
// registered with it first (AddHostRange), as the engine's pool regions are.
func checkTemplate(t *testing.T, drv cuda.Driver, c *Copier, s cuda.Stream, h headCase, perm []int) {
	t.Helper()
	n := h.bytes()
	blk := uint64(h.tokens * h.heads * h.row)
	src, dst, devCopy := hostMem(t, drv, n), hostMem(t, drv, n), hostMem(t, drv, n)
	if !c.Capabilities().HostPointerIdentity {
		for _, b := range [][]byte{src, dst} {
			require.NoError(t, c.AddHostRange(uintptr(addr(b)), n))
			defer func() { require.NoError(t, c.RemoveHostRange(uintptr(addr(b)))) }()
		}
	}
	dev := devMem(t, drv, n)
	_, _ = rand.Read(src)
	poison(dst, 0xEE)
	require.NoError(t, drv.MemsetD8(dev, 0xDD, n))
	require.NoError(t, drv.CtxSynchronize())
	blocks := func(host []byte) []TemplateBlock {
		var bs []TemplateBlock
		for b := range h.blocks {
			bs = append(bs, TemplateBlock{Host: addr(host) + uint64(perm[b])*blk, ID: uint64(b)})
		}
		return bs
	}
	for _, dir := range []Path{H2D, D2H} {
		tp, err := c.NewTemplate(dir, h.pieces(uint64(dev)))
		require.NoError(t, err)
		require.Equal(t, uint64(h.count*h.tokens*h.row), tp.Bytes())
		host := src
		if dir == D2H {
			host = dst
		}
		tk, err := c.SubmitTemplate(s, tp, blocks(host))
		require.NoError(t, err)
		waitRetire(t, drv, c, s, tk)
		if dir == H2D {
			require.NoError(t, drv.Memcpy(cuda.DevicePtr(addr(devCopy)), dev, n))
		}
	}
	for b := range h.blocks {
		hb := perm[b]
		for tok := range h.tokens {
			for x := range h.heads {
				in := x >= h.first && x < h.first+h.count
				for e := range h.row {
					di, hi := h.devIndex(b, tok, x, e), h.hostIndex(hb, tok, x, e)
					wantDev, wantHost := byte(0xDD), byte(0xEE)
					if in {
						wantDev, wantHost = src[hi], src[hi]
					}
					if devCopy[di] != wantDev || dst[hi] != wantHost {
						t.Fatalf("%v by template: block %d (host %d) token %d head %d byte %d: device %#x (want %#x), host %#x (want %#x)",
							h, b, hb, tok, x, e, devCopy[di], wantDev, dst[hi], wantHost)
					}
				}
			}
		}
	}
}

func shuffled(n int, seed uint64) []int {
	p := mrand.New(mrand.NewPCG(seed, 1)).Perm(n)
	return p
}

// Template launches copy the head cases byte for byte, with blocks in
// shuffled host slots, tables split over launches (small descriptor
// tables), pieces cut in chunks, and host pointers translated.
func TestSubmitTemplateFake(t *testing.T) {
	for _, identity := range []int{1, 0} {
		drv := cudatest.OpenFake(t, cudafake.Options{MaxDelay: 20_000, Attributes: map[cuda.Attribute]int{cuda.AttrCanUseHostPointerForRegisteredMem: identity}})
		s := newStream(t, drv)
		many := headCase{blocks: 40, tokens: 4, heads: 4, row: 64, first: 1, count: 2}
		for _, r := range []struct {
			o     Options
			cases []headCase
		}{
			{Options{PTX: fakePTX}, append([]headCase{many}, headCases...)},
			// Pieces cut in chunks.
			{Options{Method: MethodKernel, PTX: fakePTX, DescCapacity: 80, ChunkBytes: 1024}, headCases},
			// 16 blocks a table: 40 blocks take three launches.
			{Options{PTX: fakePTX, DescCapacity: 12}, []headCase{many}},
		} {
			c := newCopier(t, drv, r.o)
			require.True(t, c.Capabilities().Template)
			require.Equal(t, identity == 1, c.Capabilities().HostPointerIdentity)
			for i, h := range r.cases {
				checkTemplate(t, drv, c, s, h, shuffled(h.blocks, uint64(i)))
			}
		}
	}
}

// A template's pieces are encoded as Submit2D cuts segments: 2-D pieces of
// a chunk of rows, rows over half a chunk one piece per row in chunks,
// contiguous pieces in chunks; each direction with its own pitches.
func TestTemplateEncoding(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{})
	c := newCopier(t, drv, Options{PTX: fakePTX, ChunkBytes: 1024})
	ps := []TemplatePiece{
		{Dev: 0x90000, DevStride: 0x10000, HostOff: 0, Rows: 16, RowLen: 256, DevPitch: 2048, HostPitch: 256},
		{Dev: 0xA0000, DevStride: 0x10000, HostOff: 4096, Rows: 2, RowLen: 768, DevPitch: 1536, HostPitch: 768},
		{Dev: 0xB0000, DevStride: 0x20000, HostOff: 8192, RowLen: 2560},
	}
	tp, err := c.NewTemplate(H2D, ps)
	require.NoError(t, err)
	want := []tmplPiece{
		{Dev: 0x90000, Stride: 0x10000, HostOff: 0, Len: 256, Aux: encodeDesc2D(4, 256, 2048)},
		{Dev: 0x90000 + 4*2048, Stride: 0x10000, HostOff: 4 * 256, Len: 256, Aux: encodeDesc2D(4, 256, 2048)},
		{Dev: 0x90000 + 8*2048, Stride: 0x10000, HostOff: 8 * 256, Len: 256, Aux: encodeDesc2D(4, 256, 2048)},
		{Dev: 0x90000 + 12*2048, Stride: 0x10000, HostOff: 12 * 256, Len: 256, Aux: encodeDesc2D(4, 256, 2048)},
		{Dev: 0xA0000, Stride: 0x10000, HostOff: 4096, Len: 768},
		{Dev: 0xA0000 + 1536, Stride: 0x10000, HostOff: 4096 + 768, Len: 768},
		{Dev: 0xB0000, Stride: 0x20000, HostOff: 8192, Len: 1024},
		{Dev: 0xB0000 + 1024, Stride: 0x20000, HostOff: 8192 + 1024, Len: 1024},
		{Dev: 0xB0000 + 2048, Stride: 0x20000, HostOff: 8192 + 2048, Len: 512},
	}
	require.Equal(t, want, tp.enc)
	require.Equal(t, uint64(8192+2560), tp.HostSpan())
	require.Equal(t, uint64(16*256+2*768+2560), tp.Bytes())
	tp, err = c.NewTemplate(D2H, ps[:1])
	require.NoError(t, err)
	require.Equal(t, encodeDesc2D(4, 2048, 256), tp.enc[0].Aux, "D2H: the device's pitch is the source's")
}

// Bad templates and blocks are refused with the value and the limit, and
// nothing is launched; a Copier without template launches says why.
func TestTemplateValidation(t *testing.T) {
	drv := &launchRecorder{Driver: cudatest.OpenFake(t, cudafake.Options{})}
	c := newCopier(t, drv, Options{PTX: fakePTX, DescCapacity: 8})
	ok := TemplatePiece{Dev: 0x10000, DevStride: 0x1000, HostOff: 0, Rows: 4, RowLen: 32, DevPitch: 64, HostPitch: 32}
	cases := []struct {
		name   string
		pieces []TemplatePiece
		err    error
		msg    string
	}{
		{"empty", nil, ErrInvalidSegment, "no pieces"},
		{"no bytes", []TemplatePiece{{Dev: 0x10000, Rows: 2}}, ErrInvalidSegment, "rows of 0 bytes"},
		{"overlapping rows", []TemplatePiece{{Dev: 0x10000, Rows: 2, RowLen: 32, DevPitch: 16, HostPitch: 32}}, ErrInvalidSegment, "smaller than its rows"},
		{"misaligned", []TemplatePiece{ok, {Dev: 0x10008, RowLen: 32}}, ErrMisaligned, "piece 1"},
		{"nil", []TemplatePiece{{RowLen: 32}}, ErrInvalidSegment, "nil or overflows"},
		{"overflow", []TemplatePiece{{Dev: 0x10000, Rows: 3, RowLen: 16, DevPitch: 1 << 63, HostPitch: 16}}, ErrInvalidSegment, "overflows 64 bits"},
		// 8 descriptors of 32 bytes hold 3 pieces beside a block.
		{"too many pieces", []TemplatePiece{ok, ok, ok, ok}, ErrInvalidSegment, "more than the 3"},
		{"too many chunks", []TemplatePiece{{Dev: 0x10000, RowLen: 1 << 30}}, ErrInvalidSegment, "encode as 16384"},
	}
	for _, tc := range cases {
		_, err := c.NewTemplate(H2D, tc.pieces)
		require.ErrorIs(t, err, tc.err, tc.name)
		require.ErrorContains(t, err, tc.msg, tc.name)
	}
	_, err := c.NewTemplate(D2D, []TemplatePiece{ok})
	require.ErrorIs(t, err, ErrInvalidOption)
	tp, err := c.NewTemplate(H2D, []TemplatePiece{ok})
	require.NoError(t, err)
	blockCases := []struct {
		name   string
		blocks []TemplateBlock
		err    error
		msg    string
	}{
		{"empty", nil, ErrInvalidSegment, "empty batch"},
		{"nil host", []TemplateBlock{{Host: 0x4000}, {Host: 0}}, ErrInvalidSegment, "block 1: host 0x0"},
		{"wraps", []TemplateBlock{{Host: ^uint64(0) - 15}}, ErrInvalidSegment, "wraps"},
		{"misaligned", []TemplateBlock{{Host: 0x4008}}, ErrMisaligned, "block 0: host 0x4008"},
		{"id", []TemplateBlock{{Host: 0x4000, ID: 1 << 62}}, ErrInvalidSegment, "overflows its pieces' device addresses"},
	}
	for _, tc := range blockCases {
		_, err := c.SubmitTemplate(1, tp, tc.blocks)
		require.ErrorIs(t, err, tc.err, tc.name)
		require.ErrorContains(t, err, tc.msg, tc.name)
	}
	_, err = c.SubmitTemplate(1, nil, []TemplateBlock{{Host: 0x4000}})
	require.ErrorIs(t, err, ErrInvalidOption)
	// A template another Copier made (here one whose larger tables hold
	// pieces that c's 8-descriptor table could not hold beside a block).
	big := newCopier(t, drv, Options{PTX: fakePTX, DescCapacity: 100})
	other, err := big.NewTemplate(H2D, []TemplatePiece{ok, ok, ok, ok, ok})
	require.NoError(t, err)
	_, err = c.SubmitTemplate(1, other, []TemplateBlock{{Host: 0x4000}, {Host: 0x8000}})
	require.ErrorIs(t, err, ErrInvalidOption)
	require.ErrorContains(t, err, "another Copier")
	require.Empty(t, drv.args, "nothing launched")

	for _, o := range []Options{{PTX: fakePTX, Method: MethodMemcpy}, {PTX: fakePTX, Method: MethodBatch}, {PTX: fakePTX, CopyKernel: StreamingCopyKernel}} {
		c := newCopier(t, drv, o)
		for _, dir := range []Path{H2D, D2H} {
			_, err := c.NewTemplate(dir, []TemplatePiece{ok})
			require.ErrorIs(t, err, ErrUnavailable, "%+v", o)
		}
	}
	h := newCopier(t, noTemplate{drv.Driver}, Options{PTX: fakePTX})
	require.False(t, h.Capabilities().Template)
	_, err = h.NewTemplate(H2D, []TemplatePiece{ok})
	require.ErrorIs(t, err, ErrUnavailable)
	require.ErrorContains(t, err, "no kvo_copy_tmpl")
}

// Steady-state SubmitTemplate and Retire allocate nothing.
func TestSubmitTemplateDoesNotAllocate(t *testing.T) {
	if raceEnabled {
		t.Skip("sync.Pool drops items at random under -race")
	}
	h := headCases[0]
	c, err := New(&nullDriver{}, 0, Options{DescCapacity: 128, PTX: fakePTX})
	require.NoError(t, err)
	defer func() { require.NoError(t, c.Close()) }()
	tp, err := c.NewTemplate(H2D, h.pieces(0x7000000))
	require.NoError(t, err)
	blocks := make([]TemplateBlock, 500) // several launches
	for i := range blocks {
		blocks[i] = TemplateBlock{Host: 0x100000 + uint64(i)<<16, ID: uint64(i)}
	}
	var failed error
	allocs := testing.AllocsPerRun(20, func() {
		tk, err := c.SubmitTemplate(1, tp, blocks)
		failed = errors.Join(failed, err, c.Retire(tk))
	})
	require.NoError(t, failed)
	require.Zero(t, allocs)
}

// TestGPUTemplate runs the template head cases on the GPU, byte for byte
// with poisoned destinations (skips without a GPU; fails with
// KVO_REQUIRE_GPU=1), with the default options, then the first case
// with tables split over launches.
func TestGPUTemplate(t *testing.T) {
	g := cudatest.Open(t)
	s := newStream(t, g.Drv)
	cases := append([]headCase{
		// A TP=4 rank of an 8-KV-head model: the head-sliced benchmark's shape.
		{blocks: 64, tokens: 16, heads: 8, row: 256, first: 2, count: 2},
		{blocks: 16, tokens: 64, heads: 1, row: 1152, first: 0, count: 1},
	}, headCases...)
	c := newCopier(t, g.Drv, gpuOpts(t, Options{}))
	require.True(t, c.Capabilities().Template, "the PTX image has no template kernels")
	for i, h := range cases {
		checkTemplate(t, g.Drv, c, s, h, shuffled(h.blocks, uint64(i)))
	}
	// Pieces in chunks of 1 KiB (4 rows each) and tables of 40
	// descriptors: 48 blocks a launch, the first case in two.
	c = newCopier(t, g.Drv, gpuOpts(t, Options{DescCapacity: 40, ChunkBytes: 1024}))
	checkTemplate(t, g.Drv, c, s, cases[0], shuffled(cases[0].blocks, 99))
}
