package main

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"unsafe"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
	"github.com/kvoffload/kvoffload/offload"
)

// cudaMemory is the cache in device memory (cuMemAlloc). Blocks are
// written by the kvo_fill kernel and verified by the kvo_checksum kernel,
// whose per-segment sums are compared with the sums of the expected content
// computed on the CPU (memoised per key). Its methods need the device's
// primary context current on the calling OS thread (newCUDAMemory makes it
// so; the caller keeps the goroutine locked to its thread).
type cudaMemory struct {
	lay    cacheLayout
	drv    cuda.Driver
	dev    cuda.Device
	stream cuda.Stream
	filled cuda.Event
	cp     *cudacopy.Copier
	sums   cuda.DevicePtr // one uint64 per segment of every block
	host   unsafe.Pointer // pinned: the sums copied back, and corrupt's scratch byte

	mu       sync.Mutex
	expected map[offload.Key][]uint64
}

// newCUDAMemory allocates the cache on device; the calling goroutine must
// be locked to its OS thread, which gets the device's primary context.
func newCUDAMemory(drv cuda.Driver, device int, lay cacheLayout) (m *cudaMemory, err error) {
	dev, err := drv.DeviceGet(device)
	if err != nil {
		return nil, fmt.Errorf("device %d: %w", device, err)
	}
	ctx, err := drv.PrimaryCtxRetain(dev)
	if err != nil {
		return nil, fmt.Errorf("device %d: primary context: %w", device, err)
	}
	m = &cudaMemory{lay: lay, drv: drv, dev: dev, expected: map[offload.Key][]uint64{}}
	var undo []func() error
	defer func() {
		if err != nil {
			for i := len(undo) - 1; i >= 0; i-- {
				err = errors.Join(err, undo[i]())
			}
		}
	}()
	undo = append(undo, func() error { return drv.PrimaryCtxRelease(dev) })
	if err = drv.CtxSetCurrent(ctx); err != nil {
		return nil, err
	}
	free, _, err := drv.MemGetInfo()
	if err != nil {
		return nil, err
	}
	sumBytes := uint64(lay.blocks) * uint64(lay.segments()) * 8
	if need := uint64(lay.Bytes()) + sumBytes; need > free {
		return nil, fmt.Errorf("the GPU cache needs %s of device memory, device %d has %s free (lower --gpu-blocks)", formatSize(int64(need)), device, formatSize(int64(free)))
	}
	base, err := drv.MemAlloc(uint64(lay.Bytes()))
	if err != nil {
		return nil, fmt.Errorf("allocating the %s GPU cache: %w", formatSize(lay.Bytes()), err)
	}
	undo = append(undo, func() error { return drv.MemFree(base) })
	m.lay.base = uint64(base)
	if m.sums, err = drv.MemAlloc(sumBytes); err != nil {
		return nil, err
	}
	undo = append(undo, func() error { return drv.MemFree(m.sums) })
	if m.host, err = drv.MemHostAlloc(sumBytes, 0); err != nil {
		return nil, err
	}
	undo = append(undo, func() error { return drv.MemFreeHost(m.host) })
	if m.stream, err = drv.StreamCreate(cuda.StreamNonBlocking, 0); err != nil {
		return nil, err
	}
	undo = append(undo, func() error { return drv.StreamDestroy(m.stream) })
	if m.filled, err = drv.EventCreate(cuda.EventDisableTiming); err != nil {
		return nil, err
	}
	undo = append(undo, func() error { return drv.EventDestroy(m.filled) })
	if m.cp, err = cudacopy.New(drv, dev, cudacopy.Options{}); err != nil {
		return nil, err
	}
	if !m.cp.Capabilities().Kernel {
		err = fmt.Errorf("the fill and checksum kernels did not load: %s", m.cp.Capabilities().KernelError)
		return nil, errors.Join(err, m.cp.Close())
	}
	return m, nil
}

func (m *cudaMemory) layout() cacheLayout { return m.lay }
func (m *cudaMemory) storeAfter() uintptr { return uintptr(m.filled) }

// recompute fills the blocks with kvo_fill on the demo's stream and records
// the event a Store of them waits on. It waits for the fill (so the
// ticket can be retired and recompute time is measured as compute).
func (m *cudaMemory) recompute(ids []int, keys []offload.Key) error {
	if len(ids) == 0 {
		return nil
	}
	segs := make([]cudacopy.FillSegment, 0, len(ids)*m.lay.segments())
	for i, id := range ids {
		for s := range m.lay.segments() {
			addr, n := m.lay.segment(id, s)
			segs = append(segs, cudacopy.FillSegment{Dst: addr, Len: n, Seed: segmentSeed(keys[i], s)})
		}
	}
	t, err := m.cp.Fill(m.stream, segs, 0)
	if err != nil {
		return err
	}
	if err := m.drv.EventRecord(m.filled, m.stream); err != nil {
		return err
	}
	if err := m.drv.EventSynchronize(m.filled); err != nil {
		return err
	}
	return m.cp.Retire(t)
}

// verify runs kvo_checksum over the blocks, copies the sums back and
// compares them with the expected sums, computed on the CPU meanwhile.
func (m *cudaMemory) verify(ids []int, keys []offload.Key) ([]int, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	nseg := m.lay.segments()
	spans := make([]cudacopy.Span, 0, len(ids)*nseg)
	for _, id := range ids {
		for s := range nseg {
			addr, n := m.lay.segment(id, s)
			spans = append(spans, cudacopy.Span{Addr: addr, Len: n})
		}
	}
	t, err := m.cp.Checksum(m.stream, spans, m.sums)
	if err != nil {
		return nil, err
	}
	n := uint64(len(spans)) * 8
	err = m.drv.MemcpyAsync(cuda.DevicePtr(uintptr(m.host)), m.sums, n, m.stream)
	m.expect(keys)
	err = errors.Join(err, m.drv.StreamSynchronize(m.stream))
	if err != nil {
		return nil, err
	}
	if err := m.cp.Retire(t); err != nil {
		return nil, err
	}
	got := unsafe.Slice((*uint64)(m.host), len(spans))
	var bad []int
	m.mu.Lock()
	defer m.mu.Unlock()
	for i, k := range keys {
		want := m.expected[k]
		for s := range nseg {
			if got[i*nseg+s] != want[s] {
				bad = append(bad, i)
				break
			}
		}
	}
	return bad, nil
}

// expect computes (once per key) the checksum of each segment's expected
// content, on every CPU.
func (m *cudaMemory) expect(keys []offload.Key) {
	m.mu.Lock()
	var todo []offload.Key
	for _, k := range keys {
		if _, ok := m.expected[k]; !ok {
			m.expected[k] = nil
			todo = append(todo, k)
		}
	}
	m.mu.Unlock()
	nseg := m.lay.segments()
	_, segLen := m.lay.segment(0, 0)
	work := make(chan offload.Key)
	var wg sync.WaitGroup
	for range min(runtime.GOMAXPROCS(0), len(todo)) {
		wg.Go(func() {
			buf := make([]byte, segLen)
			for k := range work {
				sums := make([]uint64, nseg)
				for s := range nseg {
					cudacopy.FillPattern(segmentSeed(k, s), buf)
					sums[s] = cudacopy.HostChecksum(buf)
				}
				m.mu.Lock()
				m.expected[k] = sums
				m.mu.Unlock()
			}
		})
	}
	for _, k := range todo {
		work <- k
	}
	close(work)
	wg.Wait()
}

// corrupt flips the first byte of block id through a synchronous copy.
func (m *cudaMemory) corrupt(id int) error {
	addr, _ := m.lay.segment(id, 0)
	if err := m.drv.StreamSynchronize(m.stream); err != nil {
		return err
	}
	h := cuda.DevicePtr(uintptr(m.host))
	if err := m.drv.Memcpy(h, cuda.DevicePtr(addr), 1); err != nil {
		return err
	}
	*(*byte)(m.host) ^= 0xff
	return m.drv.Memcpy(cuda.DevicePtr(addr), h, 1)
}

func (m *cudaMemory) close() error {
	err := m.drv.StreamSynchronize(m.stream)
	err = errors.Join(err, m.cp.Close(), m.drv.EventDestroy(m.filled), m.drv.StreamDestroy(m.stream),
		m.drv.MemFreeHost(m.host), m.drv.MemFree(m.sums), m.drv.MemFree(cuda.DevicePtr(m.lay.base)),
		m.drv.PrimaryCtxRelease(m.dev))
	return err
}
