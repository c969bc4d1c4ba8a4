package cudadev

import (
	"errors"
	"fmt"

	"github.com/kvoffload/kvoffload/internal/cudacopy"
	"github.com/kvoffload/kvoffload/transfer"
)

// CanTemplate implements templater: the copier has a template launch for
// dir (false once the device is closed).
func (c *CUDA) CanTemplate(dir transfer.Direction) bool {
	return c.copier != nil && c.copier.TemplateAvailable(copyDir(dir)) == nil
}

// PrepareTemplate implements templater: the copier's template for dir
// (cudacopy.NewTemplate), or its error (cudacopy.ErrUnavailable where the
// PTX image or the options have no template launch).
func (c *CUDA) PrepareTemplate(dir transfer.Direction, pieces []transfer.Piece) (any, error) {
	if c.copier == nil {
		return nil, fmt.Errorf("%w: PrepareTemplate on a closed CUDA device", transfer.ErrInvalidRequest)
	}
	ps := make([]cudacopy.TemplatePiece, len(pieces))
	for i, p := range pieces {
		rows, row := p.Rows, p.RowLen
		if rows <= 1 {
			rows, row = 1, p.Len
		}
		ps[i] = cudacopy.TemplatePiece{Dev: p.Dev, DevStride: p.DevStride, HostOff: p.Host, Rows: rows, RowLen: row, DevPitch: p.DevPitch, HostPitch: p.HostPitch}
	}
	return c.copier.NewTemplate(copyDir(dir), ps)
}

// CopyTemplate implements templater: one SubmitTemplate on dir's stream
// (a load's after the open scatter is joined, as Copy's launches).
func (c *CUDA) CopyTemplate(dir transfer.Direction, prepared any, blocks []transfer.Block) (func(), error) {
	t, ok := prepared.(*cudacopy.Template)
	if !ok {
		return nil, fmt.Errorf("%w: CopyTemplate of %T, not a prepared template", transfer.ErrInvalidRequest, prepared)
	}
	if dir == transfer.Load {
		if err := c.join(dir); err != nil {
			return nil, err
		}
	}
	ts := c.tickets[:0]
	defer func() { c.tickets = ts[:0] }()
	err := c.submitTemplate(dir, t, blocks, &ts) // before ts is read: it appends
	retire, err := c.retirer(dir, ts, err)
	if err == nil {
		c.templated.Add(1)
	}
	return retire, err
}

// submitTemplate submits blocks of t in one SubmitTemplate or, where that
// needs more tables than the copier's MaxDeviceBytes can ever give one call
// (cudacopy.ErrDeviceBudget: a template of many pieces leaves room for few
// blocks a table), in halves, appending each call's ticket to ts in
// stream order.
func (c *CUDA) submitTemplate(dir transfer.Direction, t *cudacopy.Template, blocks []transfer.Block, ts *[]cudacopy.Ticket) error {
	tk, err := c.copier.SubmitTemplate(c.streams[dir], t, blocks)
	if err == nil {
		*ts = append(*ts, tk)
		return nil
	}
	if !errors.Is(err, cudacopy.ErrDeviceBudget) || len(blocks) < 2 {
		return err
	}
	c.splits.Add(1)
	if err := c.submitTemplate(dir, t, blocks[:len(blocks)/2], ts); err != nil {
		return err
	}
	return c.submitTemplate(dir, t, blocks[len(blocks)/2:], ts)
}

// Templated is how many template copies the device has enqueued (tests and
// benchmarks check that a request took the template path).
func (c *CUDA) Templated() int64 { return c.templated.Load() }

// PrepareTemplate implements templater.
func (s *Sim) PrepareTemplate(dir transfer.Direction, pieces []transfer.Piece) (any, error) {
	return s.cu.PrepareTemplate(dir, pieces)
}

// CanTemplate implements templater.
func (s *Sim) CanTemplate(dir transfer.Direction) bool { return s.cu.CanTemplate(dir) }

// CopyTemplate implements templater, failing like Copy after FailNextCopy.
func (s *Sim) CopyTemplate(dir transfer.Direction, prepared any, blocks []transfer.Block) (func(), error) {
	if err := s.takeCopyFailure(); err != nil {
		return nil, err
	}
	return s.cu.CopyTemplate(dir, prepared, blocks)
}

// Templated is the CUDA device's count of template copies.
func (s *Sim) Templated() int64 { return s.cu.Templated() }
