package cluster

import (
	"bytes"
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestFailoverUnderLoad: readers and a writer keep going while a master is
// killed under them. No hit ever holds bytes other than its key's; the dead
// master's keys become misses, counted as timeouts or errors, while no call
// blocks past the store's timeout; once its replica is promoted every key
// is a hit again, and the puts that were refused meanwhile are counted.
func TestFailoverUnderLoad(t *testing.T) {
	c := newCluster(t, 3, 1, "")
	const timeout = 300 * time.Millisecond
	s := open(t, c, Config{Timeout: timeout})
	const n, size = 120, 4000
	ks, ps := keysN(n, 21), payloads(n, size)
	putAll(t, s, ks, ps)
	waitReplicated(t, c)

	var stop atomic.Bool
	var wrong, hits, misses, slowest atomic.Int64
	var wg sync.WaitGroup
	for range 3 {
		wg.Go(func() {
			for !stop.Load() {
				ds := dstsN(n, size)
				start := time.Now()
				ok := s.Get(context.Background(), ks, ds)
				if d := int64(time.Since(start)); d > slowest.Load() {
					slowest.Store(d)
				}
				for i := range ok {
					switch {
					case !ok[i]:
						misses.Add(1)
					case !bytes.Equal(ds[i], ps[i]):
						wrong.Add(1)
					default:
						hits.Add(1)
					}
				}
			}
		})
	}
	wks, wps := keysN(50, 22), payloads(50, 100)
	var refused atomic.Int64
	wg.Go(func() {
		for i := 0; !stop.Load(); i++ {
			if !s.PutAsync(wks[i%len(wks)], wps[i%len(wps)]) {
				refused.Add(1)
			}
			time.Sleep(time.Millisecond)
		}
	})
	time.Sleep(200 * time.Millisecond)
	before := misses.Load()
	c.kill(c.ports[0])
	require.Eventually(t, func() bool {
		return misses.Load() > before
	}, 10*time.Second, 10*time.Millisecond, "the dead master's keys are misses")
	require.Eventually(t, func() bool {
		ds := dstsN(n, size)
		return count(s.Get(context.Background(), ks, ds)) == n
	}, 30*time.Second, 100*time.Millisecond, "a replica is promoted: every key a hit again")
	afterHits := hits.Load()
	time.Sleep(200 * time.Millisecond)
	stop.Store(true)
	wg.Wait()
	s.Flush()

	require.Zero(t, wrong.Load(), "hits with another key's bytes")
	require.Greater(t, hits.Load(), afterHits, "the readers hit again after the failover")
	st := s.Stats()
	require.Positive(t, st.Timeouts+st.Errors, "%+v", st)
	// A Get waits for the network no longer than its timeout (with room for
	// the race detector and a busy machine), even while a master is gone.
	require.Less(t, time.Duration(slowest.Load()), 10*timeout, "the slowest Get")
	t.Logf("hits %d, misses %d, puts refused %d, slowest Get %v, %+v", hits.Load(), misses.Load(), refused.Load(), time.Duration(slowest.Load()), st)
}
