package benchgpu

// What a run submits: the variants (one copier configuration each) and
// their fans of extra streams, submitSide, the segment sets of one size,
// and the per-direction, interleaved ("both") and pipelined submissions
// built on submitSide. No locks.

import (
	"errors"
	"math/rand/v2"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
)

// variant is one copier configuration of the benchmark.
type variant struct {
	name   string
	method cudacopy.Method
	ctas   int
	c      *cudacopy.Copier
	// h2d, when set, submits the H2D side instead of c.
	h2d *cudacopy.Copier
	// fan, when set, spreads a run's DMA submissions over more streams.
	fan *fan
}

// copier is the copier that submits v's segments in d.
func (v *variant) copier(d cudacopy.Path) *cudacopy.Copier {
	if d == cudacopy.H2D && v.h2d != nil {
		return v.h2d
	}
	return v.c
}

// close closes the copiers of a variant made by sweepVariant (its fan is
// the bench's to release).
func (v *variant) close() error {
	if v.h2d == nil {
		return v.c.Close()
	}
	return errors.Join(v.c.Close(), v.h2d.Close())
}

// methodFor is the method v's copier takes for segs in dir: its forced
// method, or what MethodAuto chooses for them.
func (v *variant) methodFor(d cudacopy.Path, segs []cudacopy.Segment) cudacopy.Method {
	c := v.copier(d)
	if m := c.Options().Method; m != cudacopy.MethodAuto {
		return m
	}
	return c.Choose(d, segs)
}

// fan is a variant's extra streams per direction ([0] D2H, [1] H2D), each
// with an event that joins it back into the bench's stream of that
// direction. A side submitted with a DMA method spreads its segments over
// them; a kernel side stays on the bench's stream, one launch at a time.
type fan struct {
	s  [2][]cuda.Stream
	ev [2][]cuda.Event
}

// newFan creates n streams and events per direction at priority prio.
func (b *bench) newFan(n, prio int) (*fan, error) {
	f := &fan{}
	for d := range f.s {
		for range n {
			s, err := b.drv.StreamCreate(cuda.StreamNonBlocking, prio)
			if err != nil {
				return nil, err
			}
			b.onClose(func() error { return b.drv.StreamDestroy(s) })
			e, err := b.drv.EventCreate(cuda.EventDisableTiming)
			if err != nil {
				return nil, err
			}
			b.onClose(func() error { return b.drv.EventDestroy(e) })
			f.s[d], f.ev[d] = append(f.s[d], s), append(f.ev[d], e)
		}
	}
	return f, nil
}

// submitSide submits one direction's segments of v: on s, or, for a DMA
// copier with a fan, split evenly over the fan's streams, which start
// after b.ev[0] (the run's start) and join back into s.
func (b *bench) submitSide(v *variant, t *[]tk, s cuda.Stream, d cudacopy.Path, segs []cudacopy.Segment) error {
	c := v.copier(d)
	side := 0
	if d == cudacopy.H2D {
		side = 1
	}
	if v.fan == nil || c.Options().Method == cudacopy.MethodKernel {
		x, err := c.Submit(s, d, segs)
		if err != nil {
			return err
		}
		*t = append(*t, tk{c, x})
		return nil
	}
	ss, evs := v.fan.s[side], v.fan.ev[side]
	for i, fs := range ss {
		lo, hi := i*len(segs)/len(ss), (i+1)*len(segs)/len(ss)
		if err := b.drv.StreamWaitEvent(fs, b.ev[0], 0); err != nil {
			return err
		}
		if lo < hi {
			x, err := c.Submit(fs, d, segs[lo:hi])
			if err != nil {
				return err
			}
			*t = append(*t, tk{c, x})
		}
		if err := errors.Join(b.drv.EventRecord(evs[i], fs), b.drv.StreamWaitEvent(s, evs[i], 0)); err != nil {
			return err
		}
	}
	return nil
}

// segSet is the D2H (devA → hostA) and H2D (hostB → devB) segments of one size.
type segSet struct{ d2h, h2d []cudacopy.Segment }

func (b *bench) segments(size uint64) segSet {
	rng := rand.New(rand.NewPCG(b.cfg.Seed, size))
	n := int(b.cfg.TotalBytes / size)
	return segSet{
		d2h: cudacopy.ScatteredSegments(cudacopy.D2H, b.hostA.addr(), uint64(b.devA), size, n, rng),
		h2d: cudacopy.ScatteredSegments(cudacopy.H2D, b.hostB.addr(), uint64(b.devB), size, n, rng),
	}
}

// Segments per Submit when both directions interleave: small enough that
// the second stream starts early, and where both directions take the
// kernel (forced, or chosen by MethodAuto for the whole run) one full
// descriptor buffer, so that parts do not each hold a mostly empty buffer.
// MethodAuto is submitted in the parts of the method it takes: in kernel
// parts, a run that took the batch API both ways left the H2D stream idle
// while the CPU enqueued the D2H side, and ran well below the forced batch
// API.
const (
	dmaPart    = 8192
	kernelPart = cudacopy.DefaultDescCapacity
)

// enqueueFor returns the submission of one run of v in dir.
func (b *bench) enqueueFor(v *variant, dir string, segs segSet) func(*[]tk) error {
	switch dir {
	case "d2h":
		return func(t *[]tk) error { return b.submitSide(v, t, b.s[0], cudacopy.D2H, segs.d2h) }
	case "h2d":
		return func(t *[]tk) error { return b.submitSide(v, t, b.s[1], cudacopy.H2D, segs.h2d) }
	}
	part := dmaPart
	if v.methodFor(cudacopy.D2H, segs.d2h) == cudacopy.MethodKernel && v.methodFor(cudacopy.H2D, segs.h2d) == cudacopy.MethodKernel {
		part = kernelPart
	}
	if v.fan != nil && v.methodFor(cudacopy.D2H, segs.d2h) != cudacopy.MethodKernel && v.methodFor(cudacopy.H2D, segs.h2d) != cudacopy.MethodKernel {
		// Both sides are fanned: each is one submission per stream already.
		part = len(segs.d2h)
	}
	return func(t *[]tk) error {
		for lo := 0; lo < len(segs.d2h); lo += part {
			hi := min(lo+part, len(segs.d2h))
			if err := b.submitSide(v, t, b.s[0], cudacopy.D2H, segs.d2h[lo:hi]); err != nil {
				return err
			}
			if err := b.submitSide(v, t, b.s[1], cudacopy.H2D, segs.h2d[lo:hi]); err != nil {
				return err
			}
		}
		return nil
	}
}

// pipeParts is how many back-to-back Submits the pipelined run splits a
// direction's segments into: what a serving engine does, building the next
// batch's descriptors while earlier copies are in flight.
const pipeParts = 8

// pipelinedFor returns the pipelined submission of one run of v in dir:
// each direction's segments in pipeParts Submits (interleaved for "both").
func (b *bench) pipelinedFor(v *variant, dir string, segs segSet) func(*[]tk) error {
	type side struct {
		s    cuda.Stream
		d    cudacopy.Path
		segs []cudacopy.Segment
	}
	var sides []side
	if dir != "h2d" {
		sides = append(sides, side{b.s[0], cudacopy.D2H, segs.d2h})
	}
	if dir != "d2h" {
		sides = append(sides, side{b.s[1], cudacopy.H2D, segs.h2d})
	}
	return func(t *[]tk) error {
		for p := range pipeParts {
			for _, sd := range sides {
				n := len(sd.segs)
				lo, hi := p*n/pipeParts, (p+1)*n/pipeParts
				if lo == hi {
					continue
				}
				if err := b.submitSide(v, t, sd.s, sd.d, sd.segs[lo:hi]); err != nil {
					return err
				}
			}
		}
		return nil
	}
}
