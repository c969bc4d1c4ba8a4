package cudacopy

import (
	"errors"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
)

func TestCalibrationConfigDefaultsAndValidate(t *testing.T) {
	d := CalibrationConfig{}.withDefaults()
	require.Equal(t, CalibrationConfig{
		TotalBytes: 32 << 20, SegSizes: DefaultSegSizes, PieceBytes: 16 << 20, PieceSegs: 1024,
		Pieces: 4, Reps: 2, PointBudget: 4 * time.Millisecond,
	}, d)
	require.NoError(t, d.validate())
	require.Equal(t, uint64(8<<20), CalibrationConfig{TotalBytes: 8 << 20}.withDefaults().PieceBytes, "PieceBytes defaults to at most TotalBytes")
	for name, c := range map[string]CalibrationConfig{
		"reps":         {Reps: -1},
		"pieces":       {Pieces: -1},
		"piece segs":   {PieceSegs: -2},
		"budget":       {PointBudget: -time.Millisecond},
		"piece bytes":  {TotalBytes: 1 << 20, PieceBytes: 2 << 20},
		"segment size": {SegSizes: []uint64{4097}},
		"segment fits": {TotalBytes: 1 << 20, SegSizes: []uint64{2 << 20}},
	} {
		require.ErrorIs(t, c.withDefaults().validate(), ErrInvalidOption, name)
	}
}

// pieces cuts a size's segments into Submits bounded by PieceBytes and
// PieceSegs, never below one segment, dropping the remainder.
func TestCalibrationPieces(t *testing.T) {
	for _, tc := range []struct {
		name              string
		cfg               CalibrationConfig
		n                 int
		size              uint64
		wantPieces, wantN int
	}{
		{"segment bound", CalibrationConfig{PieceBytes: 16 << 20, PieceSegs: 1024}, 8192, 4 << 10, 8, 1024},
		{"byte bound", CalibrationConfig{PieceBytes: 16 << 20, PieceSegs: 1024}, 512, 64 << 10, 2, 256},
		{"segment larger than a piece", CalibrationConfig{PieceBytes: 1 << 20, PieceSegs: 1024}, 3, 2 << 20, 3, 1},
		{"remainder dropped", CalibrationConfig{PieceBytes: 1 << 20, PieceSegs: 3}, 10, 4 << 10, 3, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := tc.cfg.pieces(segsOf(tc.n, tc.size, 0), tc.size)
			require.Len(t, p, tc.wantPieces)
			for _, x := range p {
				require.Len(t, x, tc.wantN)
			}
		})
	}
}

// Calibrate on the fake driver records every method at every point and
// the pipeline shape it used.
func TestCalibratePipelinedFake(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{})
	s := newStream(t, drv)
	c := newCopier(t, drv, Options{PTX: fakePTX, Calibrate: CalibrationConfig{TotalBytes: 256 << 10, SegSizes: []uint64{4 << 10, 64 << 10}, PieceBytes: 64 << 10, PieceSegs: 8}})
	cal, err := c.Calibrate(s)
	require.NoError(t, err)
	require.NoError(t, cal.Validate())
	require.Equal(t, uint64(256<<10), cal.TotalBytes)
	require.Equal(t, uint64(64<<10), cal.PieceBytes)
	require.Equal(t, DefaultPieces, cal.Pieces)
	require.Len(t, cal.Entries, 2*2*3)
	for _, e := range cal.Entries {
		require.Positive(t, e.GBps, "%+v", e)
		require.False(t, math.IsInf(e.GBps, 0), "%+v", e)
	}
}

// failingLaunch fails the copy kernel's launches from the nth on.
type failingLaunch struct {
	cuda.Driver
	n, calls int
}

var errInjected = errors.New("injected launch failure")

func (d *failingLaunch) LaunchKernel(f cuda.Function, grid, block cuda.Dim3, shared uint32, s cuda.Stream, args ...[]byte) error {
	if d.calls++; d.calls >= d.n {
		return errInjected
	}
	return d.Driver.LaunchKernel(f, grid, block, shared, s, args...)
}

// A launch failing part-way through a pipeline fails Calibrate with the
// driver's error, installs nothing, and leaves no ticket unretired (Close,
// in newCopier's cleanup, would report ErrInFlight) and nothing allocated.
func TestCalibrateFailureRetiresEverything(t *testing.T) {
	for _, n := range []int{1, 3, 9} {
		drv := &failingLaunch{Driver: cudatest.OpenFake(t, cudafake.Options{}), n: n}
		s := newStream(t, drv)
		c := newCopier(t, drv, Options{PTX: fakePTX, Calibrate: CalibrationConfig{TotalBytes: 256 << 10, SegSizes: []uint64{4 << 10, 64 << 10}, PieceBytes: 64 << 10, PieceSegs: 8}})
		_, err := c.Calibrate(s)
		require.ErrorIs(t, err, errInjected, "failing launch %d", n)
		require.Nil(t, c.Calibration())
	}
}

func TestDMAMarginOption(t *testing.T) {
	for _, tc := range []struct {
		name   string
		opts   Options
		want   float64
		d2h64K Method // the batch API is 9% behind the kernel there on the H200
	}{
		{"default", Options{}, DefaultDMAMargin, MethodKernel},
		{"prefer dma", Options{PreferDMA: true}, PreferDMAMargin, MethodBatch},
		{"explicit wins", Options{PreferDMA: true, DMAMargin: 0.05}, 0.05, MethodKernel},
		{"explicit wide", Options{DMAMargin: 0.1}, 0.1, MethodBatch},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.opts.PTX, tc.opts.Calibration = fakePTX, h200Table()
			c, err := New(&nullDriver{}, 0, tc.opts)
			require.NoError(t, err)
			require.Equal(t, tc.want, c.Options().DMAMargin)
			require.Equal(t, tc.d2h64K, c.Choose(D2H, segsOf(64, 64<<10, 0)))
			require.NoError(t, c.Close())
		})
	}
	for _, m := range []float64{-0.1, 1, 2, math.NaN(), math.Inf(1)} {
		_, err := New(&nullDriver{}, 0, Options{PTX: fakePTX, DMAMargin: m})
		require.ErrorIs(t, err, ErrInvalidOption, "DMAMargin %v", m)
	}
}
