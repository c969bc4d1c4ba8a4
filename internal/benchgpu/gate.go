package benchgpu

// The gate: a kvo_fill launch that only spins, holding the bench's
// streams while a run is enqueued so that the events time GPU work alone;
// its bounds, and setupGate, which measures the GPU clock it is sized
// with. No locks.

import (
	"errors"
	"fmt"
	"time"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

// gate holds a stream behind a kvo_fill launch that only spins (no
// descriptors), so that everything enqueued behind it starts at once: the
// timed region then holds GPU work alone, not the CPU time of building and
// enqueueing it. A CUDA event cannot be signalled by the host, hence the
// spin, sized from a measured submit time.
type gate struct {
	fn          cuda.Function
	table       cuda.DevicePtr // 32 bytes, never read (n = 0)
	cyclesPerMs float64        // GPU clock, measured with events
}

// Bounds of the gate: the margin added to twice the measured submit time,
// and the longest gate used; a submission slower than half of it (one
// memcpy per 4 KiB segment of 2 GiB) is timed ungated, as its rate is its
// CPU cost whatever the GPU does.
const (
	gateMargin = 200 * time.Microsecond
	maxGate    = 250 * time.Millisecond
)

// setupGate loads kvo_fill from the bench's module and measures the GPU
// clock; without the kernel the runs are timed ungated (b.gate nil).
func (b *bench) setupGate() error {
	drv := b.drv
	mod, skipped, err := b.module()
	if err != nil || skipped != "" {
		return err
	}
	fn, err := drv.ModuleGetFunction(mod, "kvo_fill")
	if err != nil {
		return nil
	}
	table, err := drv.MemAlloc(32)
	if err != nil {
		return fmt.Errorf("bench: gate table: %w", err)
	}
	b.onClose(func() error { return drv.MemFree(table) })
	g := &gate{fn: fn, table: table}
	const probe = 2_000_000
	var ms float32
	for range 2 {
		err := errors.Join(drv.EventRecord(b.ev[0], b.s[0]), g.launch(drv, b.s[0], probe), drv.EventRecord(b.ev[2], b.s[0]))
		if err == nil {
			err = drv.StreamSynchronize(b.s[0])
		}
		if err == nil {
			ms, err = drv.EventElapsedTime(b.ev[0], b.ev[2])
		}
		if err != nil {
			return fmt.Errorf("bench: gate clock: %w", err)
		}
	}
	if ms <= 0 {
		return fmt.Errorf("bench: gate clock: a spin of %d cycles took %v ms", probe, ms)
	}
	g.cyclesPerMs = probe / float64(ms)
	b.gate = g
	return nil
}

func (g *gate) launch(drv cuda.Driver, s cuda.Stream, cycles uint64) error {
	return drv.LaunchKernel(g.fn, cuda.Dim3{X: 1, Y: 1, Z: 1}, cuda.Dim3{X: 32, Y: 1, Z: 1}, 0, s, cuda.Arg(uint64(g.table)), cuda.Arg(uint32(0)), cuda.Arg(cycles))
}
