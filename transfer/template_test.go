package transfer_test

import (
	"bytes"
	"fmt"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	. "github.com/kvoffload/kvoffload/internal/cudadev"
	. "github.com/kvoffload/kvoffload/transfer"
)

// tmplCase is a TP rank's heads of token-major device tensors (one per
// layer and K/V, blocks × tokens × the rank's heads × row bytes) and
// head-major host slots holding every head of the model, as a head-sliced
// store or load moves them: the template's pieces, Build's segments and
// the blocks of each part.
type tmplCase struct {
	layers, tokens, heads, row int // heads: the model's
	first, count               int // the rank's
	blocks                     int
	dev, host                  uint64
	slotOf                     []int // block i's device id is i, its slot slotOf[i]
}

func (c *tmplCase) devBlock() uint64  { return uint64(c.tokens * c.count * c.row) }
func (c *tmplCase) headBytes() uint64 { return uint64(c.tokens * c.row) }
func (c *tmplCase) slot() uint64      { return uint64(c.layers*2*c.heads) * c.headBytes() }
func (c *tmplCase) tensor(l, kv int) uint64 {
	return c.dev + uint64(2*l+kv)*uint64(c.blocks)*c.devBlock()
}

func (c *tmplCase) pieces() (ps []Piece, layerEnds []int) {
	for l := range c.layers {
		for kv := range 2 {
			for h := range c.count {
				ps = append(ps, Piece{Segment: Segment{
					Dev: c.tensor(l, kv) + uint64(h*c.row), Host: uint64((2*l+kv)*c.heads+c.first+h) * c.headBytes(),
					Len: c.headBytes(), Rows: uint64(c.tokens), RowLen: uint64(c.row), DevPitch: uint64(c.count * c.row), HostPitch: uint64(c.row),
				}, DevStride: c.devBlock()})
			}
		}
		layerEnds = append(layerEnds, len(ps))
	}
	return ps, layerEnds
}

// request returns a Request whose parts are the blocks cut into parts
// (Layered: one part a layer, every block), with both Build and Template.
func (c *tmplCase) request(dir Direction, parts int, layered bool) Request {
	ps, ends := c.pieces()
	if layered {
		parts = c.layers
	}
	per := (c.blocks + parts - 1) / parts
	span := func(p int) (int, int, []Piece) {
		if layered {
			lo := 0
			if p > 0 {
				lo = ends[p-1]
			}
			return 0, c.blocks, ps[lo:ends[p]]
		}
		return p * per, min(c.blocks, (p+1)*per), ps
	}
	req := Request{Dir: dir, Parts: parts, Layered: layered, Bytes: uint64(c.blocks*c.layers*2*c.count) * c.headBytes()}
	req.Build = func(p int, dst []Segment) ([]Segment, error) {
		from, to, pp := span(p)
		for b := from; b < to; b++ {
			for _, x := range pp {
				s := x.Segment
				s.Dev += uint64(b) * x.DevStride
				s.Host += c.host + uint64(c.slotOf[b])*c.slot()
				dst = append(dst, s)
			}
		}
		return dst, nil
	}
	tp := &Template{Pieces: ps, Blocks: func(p int, dst []Block) ([]Block, error) {
		from, to, _ := span(p)
		for b := from; b < to; b++ {
			dst = append(dst, Block{Host: c.host + uint64(c.slotOf[b])*c.slot(), ID: uint64(b)})
		}
		return dst, nil
	}}
	if layered {
		tp.LayerEnds = ends
	}
	req.Template = tp
	return req
}

// noTemplates hides a device's template copies (and only those: its other
// optional methods stay visible).
type noTemplates struct{ *Sim }

func (noTemplates) PrepareTemplate(Direction, []Piece) (any, error) {
	return nil, fmt.Errorf("templates hidden")
}

func newTmplCase(e *simEnv, blocks int, seed int64) *tmplCase {
	c := &tmplCase{layers: 3, tokens: 4, heads: 4, row: 64, first: 1, count: 2, blocks: blocks, dev: e.dev, host: e.host}
	c.slotOf = rand.New(rand.NewSource(seed)).Perm(blocks)
	return c
}

// TestTemplateSim stores a rank's heads through template requests (one
// part, three parts built by the feed, one part a layer) and loads them
// back into poisoned device tensors, byte for byte, the other heads of each
// slot untouched; the device copied templates, and the same requests on a
// device without them (Build's segments) give the same bytes.
func TestTemplateSim(t *testing.T) {
	for _, hide := range []bool{false, true} {
		for _, shape := range []struct {
			parts   int
			layered bool
		}{{1, false}, {3, false}, {0, true}} {
			t.Run(fmt.Sprintf("hidden=%v/parts=%d/layered=%v", hide, shape.parts, shape.layered), func(t *testing.T) {
				const size = 1 << 18
				var wrap func(*Sim) Device
				if hide {
					wrap = func(s *Sim) Device { return noTemplates{s} }
				}
				e := newSimEnvOn(t, size, Config{Align: 16, Builders: 2}, SimConfig{Seed: 5, MaxDelay: 20_000}, wrap)
				c := newTmplCase(e, 12, int64(shape.parts))
				devBytes := uint64(2*c.layers*c.blocks) * c.devBlock()
				require.Less(t, devBytes, uint64(size))
				r := rand.New(rand.NewSource(9))
				orig := randBytes(r, devBytes)
				require.NoError(t, e.sim.Write(e.dev, orig))
				for i := range e.hostBuf {
					e.hostBuf[i] = 0xCD
				}
				before := e.sim.Templated()
				run := func(dir Direction) {
					op, err := e.s.Submit(c.request(dir, shape.parts, shape.layered))
					require.NoError(t, err)
					require.NoError(t, op.Wait())
					require.NoError(t, op.Release())
				}
				run(Store)
				for b := range c.blocks {
					slot := e.hostBuf[uint64(c.slotOf[b])*c.slot():]
					for l := range c.layers {
						for kv := range 2 {
							for h := range c.heads {
								for tok := range c.tokens {
									got := slot[uint64((2*l+kv)*c.heads+h)*c.headBytes()+uint64(tok*c.row):][:c.row]
									want := bytes.Repeat([]byte{0xCD}, c.row)
									if h >= c.first && h < c.first+c.count {
										off := c.tensor(l, kv) - e.dev + uint64(b)*c.devBlock() + uint64((tok*c.count+h-c.first)*c.row)
										want = orig[off:][:c.row]
									}
									require.Equal(t, want, got, "block %d layer %d kv %d head %d token %d", b, l, kv, h, tok)
								}
							}
						}
					}
				}
				require.NoError(t, e.sim.Fill(e.dev, devBytes, 0x5A))
				run(Load)
				got := make([]byte, devBytes)
				require.NoError(t, e.sim.Read(e.dev, got))
				require.True(t, bytes.Equal(orig, got), "loaded tensors")
				parts := shape.parts
				if shape.layered {
					parts = c.layers
				}
				if hide {
					require.Equal(t, before, e.sim.Templated(), "no template copies")
				} else {
					require.Equal(t, before+2*int64(parts), e.sim.Templated(), "one template copy a part")
				}
			})
		}
	}
}

// A template that does not fit its request is refused at Submit; a part
// whose blocks leave the registered ranges fails its op with nothing of it
// copied, and the scheduler goes on.
func TestTemplateValidationSim(t *testing.T) {
	const size = 1 << 18
	e := newSimEnv(t, size, Config{Align: 16}, SimConfig{})
	c := newTmplCase(e, 4, 1)
	bad := []struct {
		name string
		mod  func(*Request)
		msg  string
	}{
		{"no Blocks", func(r *Request) { r.Template.Blocks = nil }, "without Blocks"},
		{"no pieces", func(r *Request) { r.Template.Pieces = nil }, "no pieces"},
		{"LayerEnds not layered", func(r *Request) { r.Template.LayerEnds = []int{len(r.Template.Pieces)} }, "not Layered"},
		{"LayerParts", func(r *Request) { r.Layered, r.Parts, r.LayerParts = true, 3, []int{1, 1, 1} }, "LayerParts"},
	}
	for _, tc := range bad {
		req := c.request(Store, 1, false)
		tc.mod(&req)
		_, err := e.s.Submit(req)
		require.ErrorIs(t, err, ErrInvalidRequest, tc.name)
		require.ErrorContains(t, err, tc.msg, tc.name)
	}
	req := c.request(Load, 1, true)
	req.Template.LayerEnds = req.Template.LayerEnds[:2]
	_, err := e.s.Submit(req)
	require.ErrorContains(t, err, "2 LayerEnds for 3 layers")

	for _, tc := range []struct {
		name  string
		block Block
	}{
		{"host past the range", Block{Host: e.host + size - c.slot()/2, ID: 0}},
		{"id past the device allocation", Block{Host: e.host, ID: size / c.devBlock()}},
	} {
		req := c.request(Load, 1, false)
		req.Bytes = uint64(c.layers*2*c.count) * c.headBytes()
		req.Template.Blocks = func(int, []Block) ([]Block, error) { return []Block{tc.block}, nil }
		op, err := e.s.Submit(req)
		require.NoError(t, err)
		require.ErrorIs(t, op.Wait(), ErrOutOfRange, tc.name)
		require.NoError(t, op.Release())
	}
	req = c.request(Load, 1, false)
	req.Template.Blocks = func(int, []Block) ([]Block, error) { return []Block{{Host: e.host + 8, ID: 0}}, nil }
	op, err := e.s.Submit(req)
	require.NoError(t, err)
	require.ErrorContains(t, op.Wait(), "not aligned to 16 bytes")
	require.NoError(t, op.Release())
	// Bytes that do not match what the blocks copy fail the op.
	req = c.request(Load, 1, false)
	req.Bytes++
	op, err = e.s.Submit(req)
	require.NoError(t, err)
	require.ErrorIs(t, op.Wait(), ErrInvalidRequest)
	require.NoError(t, op.Release())
	// A piece that Build's segments would not pass as a segment (rows
	// that do not make up its length; a host offset off the scheduler's
	// alignment) is no template: the part is Build's, whose segments
	// (made from the same pieces here) fail it, and nothing goes as a
	// template.
	for _, mod := range []func(*Piece){
		func(p *Piece) { p.Len += 16 },
		func(p *Piece) { p.Host += 8 },
	} {
		req = c.request(Store, 1, false)
		mod(&req.Template.Pieces[0])
		before := e.sim.Templated()
		op, err = e.s.Submit(req)
		require.NoError(t, err)
		require.ErrorIs(t, op.Wait(), ErrInvalidSegment)
		require.NoError(t, op.Release())
		require.Equal(t, before, e.sim.Templated(), "a bad piece went as a template")
	}
	// The scheduler still copies.
	op, err = e.s.Submit(c.request(Store, 2, false))
	require.NoError(t, err)
	require.NoError(t, op.Wait())
	require.NoError(t, op.Release())
}
