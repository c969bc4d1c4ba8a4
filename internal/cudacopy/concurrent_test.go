package cudacopy

import (
	"bytes"
	"crypto/rand"
	"fmt"
	"runtime"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
)

// TestCopierConcurrentUse backs the documented claim that a Copier is safe
// for concurrent use (run under -race): goroutines on their own OS threads
// and streams share one Copier with a single pooled descriptor buffer, each
// round-tripping its own buffers in 4 KiB segments, and every byte arrives.
func TestCopierConcurrentUse(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{MaxDelay: 20_000})
	const workers, n, seg = 4, 64 << 10, 4 << 10
	type bufs struct {
		src, dst []byte
		dev      cuda.DevicePtr
	}
	for _, m := range []Method{MethodKernel, MethodBatch, MethodMemcpy} {
		c := newCopier(t, drv, Options{Method: m, PTX: fakePTX, DescCapacity: 5, DescBuffers: 1, BatchMax: 4})
		bs := make([]bufs, workers)
		for i := range bs {
			bs[i] = bufs{hostMem(t, drv, n), hostMem(t, drv, n), devMem(t, drv, n)}
			_, _ = rand.Read(bs[i].src)
		}
		var wg sync.WaitGroup
		errs := make([]error, workers)
		for i := range workers {
			wg.Go(func() { errs[i] = copyOnThread(drv, c, bs[i].src, bs[i].dst, uint64(bs[i].dev), seg) })
		}
		wg.Wait()
		for i := range workers {
			require.NoError(t, errs[i], "%v worker %d", m, i)
			require.True(t, bytes.Equal(bs[i].src, bs[i].dst), "%v worker %d: bytes differ", m, i)
		}
	}
}

// copyOnThread copies src to dev (H2D) and dev to dst (D2H) in seg-sized
// segments on a stream of its own, from a locked thread with the primary
// context current, retiring each ticket after an event behind it.
func copyOnThread(drv cuda.Driver, c *Copier, src, dst []byte, dev, seg uint64) (err error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	ctx, err := drv.PrimaryCtxRetain(0)
	if err != nil {
		return err
	}
	defer func() {
		if e := drv.PrimaryCtxRelease(0); err == nil {
			err = e
		}
	}()
	if err := drv.CtxSetCurrent(ctx); err != nil {
		return err
	}
	s, err := drv.StreamCreate(cuda.StreamNonBlocking, 0)
	if err != nil {
		return err
	}
	defer func() {
		if e := drv.StreamDestroy(s); err == nil {
			err = e
		}
	}()
	ev, err := drv.EventCreate(cuda.EventDisableTiming)
	if err != nil {
		return err
	}
	defer func() {
		if e := drv.EventDestroy(ev); err == nil {
			err = e
		}
	}()
	n := uint64(len(src))
	var h2d, d2h []Segment
	for off := uint64(0); off < n; off += seg {
		h2d = append(h2d, Segment{Dst: dev + off, Src: addr(src) + off, Len: seg})
		d2h = append(d2h, Segment{Dst: addr(dst) + off, Src: dev + off, Len: seg})
	}
	for _, step := range []struct {
		dir  Path
		segs []Segment
	}{{H2D, h2d}, {D2H, d2h}} {
		tk, err := c.Submit(s, step.dir, step.segs)
		if err != nil {
			return fmt.Errorf("submit %v: %w", step.dir, err)
		}
		if err := drv.EventRecord(ev, s); err != nil {
			return err
		}
		if err := drv.EventSynchronize(ev); err != nil {
			return err
		}
		if err := c.Retire(tk); err != nil {
			return err
		}
	}
	return nil
}
