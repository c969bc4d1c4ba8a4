package register

import (
	"sync"

	"github.com/kvoffload/kvoffload/mmapmem"
)

// DefaultPipelineChunk is the registration range used for regions mapped
// with mmapmem.Options.DeferPrefault when a pinner's options leave it 0:
// 2 GiB, a multiple of every huge-page size, small enough that prefaulting
// the next range and registering this one overlap well (registering a
// range takes far less time than prefaulting it) and large enough that the
// per-call overhead stays negligible.
const DefaultPipelineChunk int64 = 2 << 30

// prefaultRange is mmapmem.Region.Prefault; tests replace it to inject
// prefault failures.
var prefaultRange = (*mmapmem.Region).Prefault

// eachPrefaulted calls pin(k, ranges[k]) for every range in order on the
// calling goroutine and returns the index of the first range that failed
// (len(ranges) when none did) with its error. When r's prefault is still
// deferred (mmapmem.Region.Deferred: mapped with
// mmapmem.Options.DeferPrefault and not prefaulted whole since), range k
// is prefaulted (Region.Prefault, on the region's prefault threads) before
// pin sees it, by a goroutine that works ahead: range k+1 is prefaulted
// while range k is pinned, so the whole takes about max(prefault, pin)
// plus one range, instead of their sum. A region already resident (mapped
// without DeferPrefault, or prefaulted whole ahead of Register, as
// offload's growth does for the region after the one it registers) is
// pinned range by range without any prefault. A prefault error fails its range like a pin error
// does. The prefaulting goroutine has ended by the time eachPrefaulted
// returns, so a caller rolling back ranges 0..k-1 races with nothing.
func eachPrefaulted(r *mmapmem.Region, ranges []Range, pin func(k int, rg Range) error) (int, error) {
	if !r.Deferred() {
		for k, rg := range ranges {
			if err := pin(k, rg); err != nil {
				return k, err
			}
		}
		return len(ranges), nil
	}
	// ready carries the prefault results in range order. Its one slot lets
	// the prefaulter run up to two ranges ahead of the pinning (k+1 done
	// and waiting, k+2 in progress), which absorbs jitter in either.
	ready := make(chan error, 1)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for _, rg := range ranges {
			err := prefaultRange(r, rg.Off, rg.Len)
			select {
			case ready <- err:
			case <-stop:
				return
			}
			if err != nil {
				return
			}
		}
	})
	defer func() {
		close(stop)
		wg.Wait()
	}()
	for k, rg := range ranges {
		if err := <-ready; err != nil {
			return k, err
		}
		if err := pin(k, rg); err != nil {
			return k, err
		}
	}
	return len(ranges), nil
}
