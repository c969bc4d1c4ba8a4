package cudadev

import (
	"bytes"
	"testing"
	"unsafe"

	"github.com/kvoffload/kvoffload/transfer"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
	"github.com/stretchr/testify/require"
)

// A template copy whose blocks need more descriptor tables than the
// copier's MaxDeviceBytes can ever give one call is split in halves (as
// Copy splits a batch), not failed: here 8-descriptor tables hold 3 pieces
// and 4 blocks each, the bound 2 tables, and 9 blocks need 3; every block
// still lands byte-exact.
func TestCopyTemplateSplitsOverBudget(t *testing.T) {
	drv := cudafake.New(cudafake.Options{DeviceMemory: 1 << 24, Attributes: map[cuda.Attribute]int{cuda.AttrCanUseHostPointerForRegisteredMem: 1}})
	defer func() { require.NoError(t, drv.Close()) }()
	ctx, err := drv.PrimaryCtxRetain(0)
	require.NoError(t, err)
	defer func() { require.NoError(t, drv.PrimaryCtxRelease(0)) }()
	cu, err := newCUDA(drv, 0, ctx, cudacopy.Options{Calibration: &cudacopy.Calibration{}, DescCapacity: 8, MaxDeviceBytes: 512, NoGather: true})
	require.NoError(t, err)
	defer func() { require.NoError(t, cu.Close()) }()
	require.True(t, cu.CanTemplate(transfer.Load))

	const blocks, stride, piece = 9, 256, 64
	dev, err := drv.MemAlloc(blocks * stride)
	require.NoError(t, err)
	require.NoError(t, drv.MemsetD8(dev, 0xEE, blocks*stride))
	hostP, err := drv.MemHostAlloc(blocks*stride, cuda.HostAllocPortable)
	require.NoError(t, err)
	defer func() { require.NoError(t, drv.MemFreeHost(hostP)) }()
	host := unsafe.Slice((*byte)(hostP), blocks*stride)
	for i := range host {
		host[i] = byte(i*7 + 1)
	}
	var pieces []transfer.Piece
	for k := range 3 {
		pieces = append(pieces, transfer.Piece{Segment: transfer.Segment{Dev: uint64(dev) + uint64(k*piece), Host: uint64(k * piece), Len: piece}, DevStride: stride})
	}
	prep, err := cu.PrepareTemplate(transfer.Load, pieces)
	require.NoError(t, err)
	var bs []transfer.Block
	for i := range blocks {
		bs = append(bs, transfer.Block{Host: uint64(uintptr(hostP)) + uint64(i*stride), ID: uint64(i)})
	}
	splits := cu.BudgetSplits()
	retire, err := cu.CopyTemplate(transfer.Load, prep, bs)
	require.NoError(t, err)
	require.NoError(t, drv.StreamSynchronize(cu.streams[transfer.Load]))
	retire()
	require.Greater(t, cu.BudgetSplits(), splits, "the copy was split")
	gotP, err := drv.MemHostAlloc(blocks*stride, cuda.HostAllocPortable)
	require.NoError(t, err)
	defer func() { require.NoError(t, drv.MemFreeHost(gotP)) }()
	require.NoError(t, drv.Memcpy(cuda.DevicePtr(uintptr(gotP)), dev, blocks*stride))
	got := unsafe.Slice((*byte)(gotP), blocks*stride)
	for i := range blocks {
		b := i * stride
		require.True(t, bytes.Equal(host[b:b+3*piece], got[b:b+3*piece]), "block %d", i)
		require.Equal(t, bytes.Repeat([]byte{0xEE}, stride-3*piece), got[b+3*piece:b+stride], "block %d past its pieces", i)
	}
}

// A closed CUDA device templates nothing and says so, without a panic.
func TestTemplateAfterClose(t *testing.T) {
	drv := cudafake.New(cudafake.Options{DeviceMemory: 1 << 24})
	defer func() { require.NoError(t, drv.Close()) }()
	ctx, err := drv.PrimaryCtxRetain(0)
	require.NoError(t, err)
	defer func() { require.NoError(t, drv.PrimaryCtxRelease(0)) }()
	cu, err := newCUDA(drv, 0, ctx, cudacopy.Options{Calibration: &cudacopy.Calibration{}})
	require.NoError(t, err)
	require.True(t, cu.CanTemplate(transfer.Store))
	require.NoError(t, cu.Close())
	require.False(t, cu.CanTemplate(transfer.Store))
	_, err = cu.PrepareTemplate(transfer.Store, []transfer.Piece{{Segment: transfer.Segment{Dev: 1 << 20, Len: 64}}})
	require.ErrorIs(t, err, transfer.ErrInvalidRequest)
}
