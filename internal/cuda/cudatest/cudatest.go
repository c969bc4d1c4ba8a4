// Package cudatest gives tests a real CUDA driver with the primary context of
// device 0 current on a locked OS thread, or skips the test when there is no
// driver. With KVO_REQUIRE_GPU=1 in the environment a missing driver fails
// the test instead, so a GPU run cannot pass by skipping.
//
// The context is current only on the thread of the goroutine that called
// Open. Subtests (t.Run) and benchmarks' sub-runs run on goroutines of their
// own: a subtest that calls the driver calls GPU.Lock first. OpenFake does the
// same with the fake driver, for tests that run everywhere.
package cudatest

import (
	"os"
	"runtime"
	"testing"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
)

// Required reports whether KVO_REQUIRE_GPU=1 asks for GPU tests to fail
// rather than skip.
func Required() bool { return os.Getenv("KVO_REQUIRE_GPU") == "1" }

// Skip skips (or, when Required, fails) t with the reason.
func Skip(t testing.TB, reason string) {
	t.Helper()
	if Required() {
		t.Fatalf("GPU required (KVO_REQUIRE_GPU=1) but unavailable: %s", reason)
	}
	t.Skip(reason)
}

// GPU is a loaded driver with device 0's primary context.
type GPU struct {
	Drv cuda.Driver
	Dev cuda.Device
	Ctx cuda.Context
}

// Open loads the driver, retains device 0's primary context and makes it
// current on the calling goroutine's OS thread, which it locks for the rest
// of the test. The context is released when the test ends.
func Open(t testing.TB) *GPU {
	t.Helper()
	drv, err := cuda.Load()
	if err != nil {
		Skip(t, err.Error())
	}
	n, err := drv.DeviceCount()
	if err != nil || n == 0 {
		Skip(t, "no CUDA device")
	}
	dev, err := drv.DeviceGet(0)
	if err != nil {
		t.Fatalf("DeviceGet(0): %v", err)
	}
	ctx, err := drv.PrimaryCtxRetain(dev)
	if err != nil {
		t.Fatalf("PrimaryCtxRetain: %v", err)
	}
	runtime.LockOSThread()
	if err := drv.CtxSetCurrent(ctx); err != nil {
		t.Fatalf("CtxSetCurrent: %v", err)
	}
	t.Cleanup(func() {
		_ = drv.PrimaryCtxRelease(dev)
		runtime.UnlockOSThread()
	})
	return &GPU{Drv: drv, Dev: dev, Ctx: ctx}
}

// Lock locks the calling goroutine to its OS thread and makes g's context
// current on it for the rest of t (a subtest, whose goroutine is not the
// one Open locked). Cleanups t registers afterwards run on that thread
// before it is unlocked.
func (g *GPU) Lock(t testing.TB) {
	t.Helper()
	runtime.LockOSThread()
	t.Cleanup(runtime.UnlockOSThread)
	if err := g.Drv.CtxSetCurrent(g.Ctx); err != nil {
		t.Fatalf("CtxSetCurrent: %v", err)
	}
}

// OpenFake returns a fake driver (cudafake, with CheckContext set) whose
// primary context of device 0 is current on the test's goroutine, locked to
// its OS thread until the test ends. At the end it releases the context
// and, unless the test already failed, fails it if anything is left
// allocated, registered or created.
func OpenFake(t testing.TB, opts cudafake.Options) *cudafake.Driver {
	t.Helper()
	opts.CheckContext = true
	d := cudafake.New(opts)
	runtime.LockOSThread()
	ctx, err := d.PrimaryCtxRetain(0)
	if err == nil {
		err = d.CtxSetCurrent(ctx)
	}
	if err != nil {
		runtime.UnlockOSThread()
		t.Fatalf("cudatest: fake context: %v", err)
	}
	t.Cleanup(func() {
		defer runtime.UnlockOSThread()
		if !t.Failed() {
			if err := d.PrimaryCtxRelease(0); err != nil {
				t.Errorf("cudatest: releasing the fake context: %v", err)
			}
			if live := d.Live(); !live.IsZero() {
				t.Errorf("cudatest: leaked: %+v", live)
			}
		}
		if err := d.Close(); err != nil {
			t.Errorf("cudatest: closing the fake: %v", err)
		}
	})
	return d
}
