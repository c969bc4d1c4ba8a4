package main

import (
	"bytes"
	"fmt"
	"runtime"
	"sort"
	"sync"

	"github.com/kvoffload/kvoffload/internal/cudacopy"
	"github.com/kvoffload/kvoffload/offload"
	"github.com/kvoffload/kvoffload/offload/hostsim"
)

// kvMemory is the demo's GPU KV cache memory: the serving stack's side of
// the engine. recompute stands for prefill (it writes each block's content,
// a pure function of its key); verify checks blocks the engine loaded.
// Calls come from the demo's one serving goroutine.
type kvMemory interface {
	layout() cacheLayout
	// recompute writes the content of keys[i] into block ids[i] and returns
	// once it is written (or, on the GPU, once it is ordered before
	// storeAfter's event).
	recompute(ids []int, keys []offload.Key) error
	// storeAfter is the event a Store of recomputed blocks waits on (0 on
	// the host backend).
	storeAfter() uintptr
	// verify returns the indices i whose block ids[i] does not hold the
	// content of keys[i]. The loads must be complete.
	verify(ids []int, keys []offload.Key) ([]int, error)
	// corrupt changes one byte of block id (a test hook).
	corrupt(id int) error
	close() error
}

// hostMemory is the cache in the host backend's simulated GPU.
type hostMemory struct {
	lay  cacheLayout
	sim  *hostsim.GPU
	pool sync.Pool // *[]byte of one segment
}

func newHostMemory(sim *hostsim.GPU, lay cacheLayout) (*hostMemory, error) {
	base, err := sim.Alloc(uint64(lay.Bytes()))
	if err != nil {
		return nil, fmt.Errorf("allocating the %s simulated GPU cache: %w", formatSize(lay.Bytes()), err)
	}
	lay.base = base
	m := &hostMemory{lay: lay, sim: sim}
	_, n := lay.segment(0, 0)
	m.pool.New = func() any { b := make([]byte, n); return &b }
	return m, nil
}

func (m *hostMemory) layout() cacheLayout { return m.lay }
func (m *hostMemory) storeAfter() uintptr { return 0 }

// forEachSegment runs fn on every segment of every block, spread over the
// CPUs; the first error wins.
func (m *hostMemory) forEachSegment(ids []int, fn func(i, seg int, addr uint64, buf []byte) error) error {
	type job struct{ i, seg int }
	jobs := make(chan job)
	var (
		wg    sync.WaitGroup
		once  sync.Once
		first error
	)
	for range min(runtime.GOMAXPROCS(0), len(ids)*m.lay.segments()) {
		wg.Go(func() {
			bp := m.pool.Get().(*[]byte)
			defer m.pool.Put(bp)
			for j := range jobs {
				addr, n := m.lay.segment(ids[j.i], j.seg)
				if err := fn(j.i, j.seg, addr, (*bp)[:n]); err != nil {
					once.Do(func() { first = err })
				}
			}
		})
	}
	for i := range ids {
		for s := range m.lay.segments() {
			jobs <- job{i, s}
		}
	}
	close(jobs)
	wg.Wait()
	return first
}

func (m *hostMemory) recompute(ids []int, keys []offload.Key) error {
	return m.forEachSegment(ids, func(i, seg int, addr uint64, buf []byte) error {
		cudacopy.FillPattern(segmentSeed(keys[i], seg), buf)
		return m.sim.Write(addr, buf)
	})
}

func (m *hostMemory) verify(ids []int, keys []offload.Key) ([]int, error) {
	var (
		mu  sync.Mutex
		bad = map[int]bool{}
	)
	err := m.forEachSegment(ids, func(i, seg int, addr uint64, buf []byte) error {
		if err := m.sim.Read(addr, buf); err != nil {
			return err
		}
		want := m.pool.Get().(*[]byte)
		defer m.pool.Put(want)
		w := (*want)[:len(buf)]
		cudacopy.FillPattern(segmentSeed(keys[i], seg), w)
		if !bytes.Equal(buf, w) {
			mu.Lock()
			bad[i] = true
			mu.Unlock()
		}
		return nil
	})
	return sortedKeys(bad), err
}

func (m *hostMemory) corrupt(id int) error {
	addr, _ := m.lay.segment(id, 0)
	b := make([]byte, 1)
	if err := m.sim.Read(addr, b); err != nil {
		return err
	}
	b[0] ^= 0xff
	return m.sim.Write(addr, b)
}

func (m *hostMemory) close() error { return m.sim.Free(m.lay.base) }

func sortedKeys(set map[int]bool) []int {
	out := make([]int, 0, len(set))
	for k := range set {
		out = append(out, k)
	}
	sort.Ints(out)
	return out
}
