package disk

import (
	"context"
	"sync"
	"sync/atomic"
)

// PutAll writes the records of blocks 0..n-1 (key(i), payload(i)) that
// the store does not hold yet, with writers goroutines: the write-back of
// a whole pool at Close (the embedded engine's and the node's
// DiskConfig.WriteBackOnClose). A block whose payload is nil (its memory
// gone) is skipped. No write starts once ctx has ended: each writer checks
// ctx just before it starts one, so at most the writes already running
// when ctx ends complete. before, if set, runs before each write (tests).
// It returns how many records it wrote, how many writes the store
// refused, and how many blocks were left unwritten because ctx ended (of
// those with a payload that the store does not hold).
func (s *Store) PutAll(ctx context.Context, n, writers int, key func(i int) [16]byte, payload func(i int) []byte, before func(i int)) (written, failed, left int64) {
	var w, f, l atomic.Int64
	next := make(chan int)
	var wg sync.WaitGroup
	for range max(writers, 1) {
		wg.Go(func() {
			for i := range next {
				k, mem := key(i), payload(i)
				if mem == nil || s.Contains(k) {
					continue
				}
				if ctx.Err() != nil {
					l.Add(1)
					continue
				}
				if before != nil {
					before(i)
				}
				if err := s.Put(k, mem); err != nil {
					f.Add(1)
					continue
				}
				w.Add(1)
			}
		})
	}
	sent := 0
	for ; sent < n && ctx.Err() == nil; sent++ {
		next <- sent
	}
	close(next)
	wg.Wait()
	for i := sent; i < n; i++ {
		if payload(i) != nil && !s.Contains(key(i)) {
			l.Add(1)
		}
	}
	return w.Load(), f.Load(), l.Load()
}
