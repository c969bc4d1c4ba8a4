package offload

import (
	"fmt"
	"time"

	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/kvoffload/kvoffload/register"
)

// openCUDA sets up the CUDA backend: device Config.Device's primary
// context (the one a serving stack's CUDA runtime already uses), a pinner
// registering regions with cuMemHostRegister in ≤ 64 GiB ranges, and the
// transfer layer's CUDA device (its streams, and the copy kernels' PTX
// module, loaded here). Before anything else is set up, every tensor of the
// layout must lie in device memory (checkDeviceTensors).
func (e *Engine) openCUDA(c backendChoice) error {
	gpu, err := c.drv.Open(e.cfg.Device)
	if err != nil {
		return err
	}
	e.gpu = gpu
	if err := gpu.Do(e.checkDeviceTensors); err != nil {
		return err
	}
	if e.pinner, err = register.NewCUDA(gpu, register.CUDAOptions{RangeLimit: e.hooks.rangeLimit, PipelineChunk: pipelineChunk(e.slot)}); err != nil {
		return err
	}
	// The automatic choice of copy method is calibrated (a fraction of a
	// second) by the growth goroutine once the pool is grown; until then
	// the copier uses its uncalibrated rule.
	copyOpts := e.hooks.copyOptions
	noPitch, err := envSwitch(noPitchedStagingEnv)
	if err != nil {
		return err
	}
	if noPitch {
		copyOpts.GatherMinRow = -1
	}
	chunkMiB, err := compareInt(gatherChunkEnv, 0, 0, 64, "MiB")
	if err != nil {
		return err
	}
	if chunkMiB > 0 {
		copyOpts.GatherChunkBytes = chunkMiB << 20
	}
	e.cudaDev, err = gpu.NewCUDA(cudadev.CUDAOptions{MaxDeviceBytes: e.cfg.MaxDeviceBytes, GreedyStores: e.hooks.greedyStores,
		CalibrateLater: true, Copy: copyOpts})
	if err != nil {
		return fmt.Errorf("offload: CUDA streams and copy kernels on device %d: %w", e.cfg.Device, err)
	}
	e.dev = e.cudaDev
	e.events = true
	return nil
}

// deviceTensor is the address range one tensor of the layout spans on the
// GPU, and its name in errors.
type deviceTensor struct {
	name       string
	start, end uint64
}

// deviceTensors lists the extents of Config.Layout's tensors: each from its
// base to the end of its last block's segment. The layout has passed
// withDefaults, so the extents fit in 64 bits.
func (e *Engine) deviceTensors() []deviceTensor { return deviceTensorsOf(e.cfg.Layout) }

// deviceTensorsOf is deviceTensors for layout l (checked by kvLayoutSpec
// and kvcache.NewLayout): its tensors hold the rank's KVHeads, so a
// segment is KVHeads × HeadDim × DTypeBytes × TokensPerBlock bytes and a
// cross-layer block 2 × Layers of them.
func deviceTensorsOf(l LayoutSpec) []deviceTensor {
	last := uint64(l.NumBlocks - 1)
	segLen := uint64(l.KVHeads) * uint64(l.HeadDim) * uint64(l.DTypeBytes) * uint64(l.TokensPerBlock)
	if l.Kind == LayoutCrossLayer {
		return []deviceTensor{{"cross-layer tensor", l.Base, l.Base + last*l.Stride + 2*uint64(l.Layers)*segLen}}
	}
	var ts []deviceTensor
	for i, t := range l.LayerTensors {
		ts = append(ts, deviceTensor{fmt.Sprintf("layer %d K tensor", i), t.K, t.K + last*t.Stride + segLen})
		if t.V != 0 {
			ts = append(ts, deviceTensor{fmt.Sprintf("layer %d V tensor", i), t.V, t.V + last*t.Stride + segLen})
		}
	}
	return ts
}

// checkDeviceTensors refuses a layout whose tensors are not device memory
// (ErrInvalidConfig): each tensor's extent must lie within one allocation
// (cuMemGetAddressRange), since a copy to or from anything else would raise
// a sticky CUDA_ERROR_ILLEGAL_ADDRESS that kills the serving process's
// context. Allocations from a caching allocator (PyTorch's) are segments
// holding many tensors, so a tensor is always inside one. Runs with the
// context current.
func (e *Engine) checkDeviceTensors() error { return e.checkTensorsOf(e.deviceTensors()) }

// checkTensorsOf is checkDeviceTensors for the extents ts.
func (e *Engine) checkTensorsOf(ts []deviceTensor) error {
	for _, t := range ts {
		base, size, err := e.gpu.AllocationRange(t.start)
		if err != nil {
			return fmt.Errorf("%w: Layout: %s [%#x, %#x) is not device memory of device %d: the driver finds no allocation at %#x: %w",
				ErrInvalidConfig, t.name, t.start, t.end, e.cfg.Device, t.start, err)
		}
		if allocEnd := base + size; t.end > allocEnd {
			return fmt.Errorf("%w: Layout: %s [%#x, %#x) runs %d bytes past the end of its device allocation [%#x, %#x) on device %d",
				ErrInvalidConfig, t.name, t.start, t.end, t.end-allocEnd, base, allocEnd, e.cfg.Device)
		}
	}
	return nil
}

// pipelineChunk is the registration-range size for pipelined pinning: the
// largest multiple of the slot stride (the slot size rounded up to
// kvcache's page alignment) not above register.DefaultPipelineChunk, so
// that range boundaries fall between slots and no slot is lost to them.
func pipelineChunk(slot int64) int64 {
	stride := slotStride(slot)
	return max(register.DefaultPipelineChunk/stride, 1) * stride
}

// slotAlign is the alignment of the engine's slots, its cache's
// Config.SlotAlign: a page (kvcache's default too).
const slotAlign = 4096

// slotStride is the pool bytes one slot of slot bytes takes: its size
// rounded up to slotAlign (every slot starts on a page).
func slotStride(slot int64) int64 {
	return (slot + slotAlign - 1) / slotAlign * slotAlign
}

// onThread runs f on a locked OS thread with the CUDA context current and
// capture mode relaxed (cudadev.Context.Do); on the host backend it just
// runs f.
func (e *Engine) onThread(f func() error) error {
	if e.gpu == nil {
		return f()
	}
	return e.gpu.Do(f)
}

// initGrowThread prepares the growth goroutine's locked OS thread for
// driver calls: the context current and capture mode relaxed, so pinning
// never invalidates a serving stack's graph capture on another thread.
func (e *Engine) initGrowThread() error {
	if e.gpu == nil {
		return nil
	}
	if err := e.gpu.InitThread(); err != nil {
		return fmt.Errorf("offload: growth thread: %w", err)
	}
	return nil
}

// calibrate measures the copy methods on a stream of their own and
// installs the table the copier chooses from (growth goroutine, context
// current), once: growth started again by GrowTo does not calibrate again.
// A failure leaves the uncalibrated rule in place; Stats.Copies.Calibration
// says what happened.
func (e *Engine) calibrate() {
	if e.cudaDev == nil || !e.cudaDev.CalibrationPending() {
		return
	}
	took, err := e.cudaDev.Calibrate()
	msg := fmt.Sprintf("calibrated in %v", took.Round(time.Millisecond))
	if err != nil {
		msg = "uncalibrated rule (calibration failed: " + err.Error() + ")"
	}
	e.calibration.Store(&msg)
}

// closeCUDADevice releases the CUDA device (after the scheduler is closed).
func (e *Engine) closeCUDADevice() error {
	if e.cudaDev == nil {
		return nil
	}
	err := e.gpu.Do(e.cudaDev.Close)
	if cudadev.IsContextLost(err) {
		// The context is lost: its streams and module went with it.
		return nil
	}
	return err
}

// releaseContext drops the primary context reference taken by openCUDA
// (after every region is unregistered).
func (e *Engine) releaseContext() error {
	if e.gpu == nil {
		return nil
	}
	if err := e.gpu.Release(); err != nil {
		return fmt.Errorf("offload: %w", err)
	}
	return nil
}
