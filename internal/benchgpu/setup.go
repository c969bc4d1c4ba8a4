package benchgpu

// The bench: the streams, events, host and device buffers, copiers and
// PTX module of one benchmark call (MeasureThroughput, MeasureBlocks,
// MeasureKernelVariants), their setup, and close, which releases them in
// reverse order. No locks: a bench is used from one goroutine, and
// mapHost's prefault workers write disjoint pages and join on a
// WaitGroup.

import (
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
)

// hostRegion is an mmap'd, prefaulted, registered host buffer.
type hostRegion struct {
	mem []byte
}

func (h *hostRegion) addr() uint64 { return uint64(uintptr(unsafe.Pointer(&h.mem[0]))) }

func mapHost(drv cuda.Driver, n uint64) (*hostRegion, error) {
	mem, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("bench: mmap of %d bytes: %w", n, err)
	}
	// Huge pages halve registration time (ANCHORS.md); advice only.
	_ = unix.Madvise(mem, unix.MADV_HUGEPAGE)
	const workers = 16
	var wg sync.WaitGroup
	part := (len(mem)/workers + 4095) &^ 4095
	for w := range workers {
		lo, hi := min(w*part, len(mem)), min((w+1)*part, len(mem))
		wg.Go(func() {
			for i := lo; i < hi; i += 4096 {
				mem[i] = byte(i >> 12)
			}
		})
	}
	wg.Wait()
	if err := drv.MemHostRegister(unsafe.Pointer(&mem[0]), n, cuda.HostRegisterPortable|cuda.HostRegisterDeviceMap); err != nil {
		return nil, errors.Join(fmt.Errorf("bench: registering %d bytes: %w", n, err), unix.Munmap(mem))
	}
	return &hostRegion{mem: mem}, nil
}

func (h *hostRegion) free(drv cuda.Driver) error {
	return errors.Join(drv.MemHostUnregister(unsafe.Pointer(&h.mem[0])), unix.Munmap(h.mem))
}

// bench holds the resources of one MeasureThroughput call.
type bench struct {
	drv        cuda.Driver
	cfg        ThroughputConfig
	s          [2]cuda.Stream // [0]: D2H, [1]: H2D; transfer priority
	burn       cuda.Stream
	ev         [4]cuda.Event // start, H2D side's end, end, D2H side's end
	mod        cuda.Module
	modLoaded  bool
	gate       *gate       // nil: runs are timed ungated
	hostA      *hostRegion // D2H destination
	hostB      *hostRegion // H2D source
	devA, devB cuda.DevicePtr
	variants   []*variant
	cleanup    []func() error
}

func (b *bench) onClose(f func() error) { b.cleanup = append(b.cleanup, f) }

func (b *bench) close() error {
	var errs []error
	for i := len(b.cleanup) - 1; i >= 0; i-- {
		errs = append(errs, b.cleanup[i]())
	}
	return errors.Join(errs...)
}

func (b *bench) setup(dev cuda.Device) error {
	if err := b.setupBase(); err != nil {
		return err
	}
	return b.setupCopiers(dev)
}

// setupBase creates the streams, events and buffers: everything but the
// copiers.
func (b *bench) setupBase() error {
	drv, cfg := b.drv, b.cfg
	least, greatest, err := drv.StreamPriorityRange()
	if err != nil {
		return err
	}
	if b.s, err = b.streamPair(greatest); err != nil {
		return err
	}
	if b.burn, err = drv.StreamCreate(cuda.StreamNonBlocking, least); err != nil {
		return err
	}
	b.onClose(func() error { return drv.StreamDestroy(b.burn) })
	for i := range b.ev {
		if b.ev[i], err = drv.EventCreate(cuda.EventDefault); err != nil {
			return err
		}
		e := b.ev[i]
		b.onClose(func() error { return drv.EventDestroy(e) })
	}
	if err := b.setupGate(); err != nil {
		return err
	}
	for _, h := range []**hostRegion{&b.hostA, &b.hostB} {
		r, err := mapHost(drv, cfg.TotalBytes)
		if err != nil {
			return err
		}
		*h = r
		b.onClose(func() error { return r.free(drv) })
	}
	for _, d := range []*cuda.DevicePtr{&b.devA, &b.devB} {
		p, err := drv.MemAlloc(cfg.TotalBytes)
		if err != nil {
			return fmt.Errorf("bench: device buffer of %d bytes: %w", cfg.TotalBytes, err)
		}
		*d = p
		b.onClose(func() error { return drv.MemFree(p) })
	}
	return nil
}

// streamPair creates the D2H and H2D streams at priority prio.
func (b *bench) streamPair(prio int) ([2]cuda.Stream, error) {
	var ss [2]cuda.Stream
	for i := range ss {
		s, err := b.drv.StreamCreate(cuda.StreamNonBlocking, prio)
		if err != nil {
			return ss, err
		}
		ss[i] = s
		b.onClose(func() error { return b.drv.StreamDestroy(s) })
	}
	return ss, nil
}

// newCopier creates a copier that knows both host buffers.
func (b *bench) newCopier(dev cuda.Device, o cudacopy.Options) (*cudacopy.Copier, error) {
	o.PTX = b.cfg.PTX
	c, err := cudacopy.New(b.drv, dev, o)
	if err != nil {
		return nil, err
	}
	for _, h := range []*hostRegion{b.hostA, b.hostB} {
		if err := c.AddHostRange(uintptr(unsafe.Pointer(&h.mem[0])), b.cfg.TotalBytes); err != nil {
			return nil, errors.Join(err, c.Close())
		}
	}
	return c, nil
}

func (b *bench) setupCopiers(dev cuda.Device) error {
	drv, cfg := b.drv, b.cfg
	specs := []variant{{name: "memcpy", method: cudacopy.MethodMemcpy}}
	if drv.HasMemcpyBatch() {
		specs = append(specs, variant{name: "batch", method: cudacopy.MethodBatch})
	}
	specs = append(specs, variant{name: "kernel", method: cudacopy.MethodKernel})
	for _, n := range cfg.CTAs {
		specs = append(specs, variant{name: fmt.Sprintf("kernel/%d", n), method: cudacopy.MethodKernel, ctas: n})
	}
	specs = append(specs, variant{name: "auto", method: cudacopy.MethodAuto})
	for _, v := range specs {
		o := cudacopy.Options{Method: v.method}
		if v.ctas > 0 {
			// The kernel rows: kvo_copy, unthrottled, both ways.
			o.CTAs, o.Threads, o.CopyKernel = v.ctas, cfg.Threads, cudacopy.DefaultCopyKernel
		}
		c, err := b.newCopier(dev, o)
		if err != nil {
			return fmt.Errorf("bench: copier %s: %w", v.name, err)
		}
		b.onClose(c.Close)
		v.c = c
		b.variants = append(b.variants, &v)
	}
	return nil
}

// module loads the PTX (cfg.PTX or the embedded one) once; skipped says
// why there is none.
func (b *bench) module() (mod cuda.Module, skipped string, err error) {
	if b.modLoaded {
		return b.mod, "", nil
	}
	drv := b.drv
	img := b.cfg.PTX
	if len(img) == 0 {
		if img, err = cudacopy.PTX(); err != nil {
			return mod, err.Error(), nil
		}
	}
	if mod, err = drv.ModuleLoadData(img); err != nil {
		return mod, "", fmt.Errorf("bench: loading the PTX: %w", err)
	}
	b.onClose(func() error { return drv.ModuleUnload(mod) })
	b.mod, b.modLoaded = mod, true
	return mod, "", nil
}
