package offload

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// TestStressCloseInTheMiddle runs stores, loads (with and without leases),
// lookups, deletes and two Trims from many goroutines over a pool smaller
// than the key universe, with random copy delays, and closes the engine
// while they run.
// Every load returns exactly the bytes stored under its key, every block
// of every op gets exactly one outcome, the counters add up, and no
// goroutine survives Close.
func TestStressCloseInTheMiddle(t *testing.T) {
	defer goleak.VerifyNone(t)
	for _, policy := range []string{PolicyLRU, PolicyTinyLFU} {
		t.Run(policy, func(t *testing.T) {
			sim, err := NewSimGPU(SimOptions{Seed: 7, MaxDelay: 200 * time.Microsecond})
			require.NoError(t, err)
			defer func() { require.NoError(t, sim.Close()) }()
			slot := int64(8 << 10)
			e := newTestEngine(t, Config{PoolBytes: 24 * slot, FirstRegionBytes: 8 * slot, RegionBytes: 8 * slot,
				Layout: simLayout(t, sim, 48), Policy: policy, Sim: sim, MaxInFlightBytes: 4 * slot, MaxQueuedBytes: 16 * slot})
			require.Equal(t, slot, e.slot)

			var ta tally
			var count atomic.Int64
			stop := make(chan struct{})
			wg := startWorkers(t, e, 6, 40, 1, &ta, &count, stop)
			// A trimmer gives two regions back while the workers run, and
			// may race with Close.
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := int64(1); i <= 2; i++ {
					for count.Load() < 200*i {
						select {
						case <-stop:
							return
						case <-time.After(time.Millisecond):
						}
					}
					if _, err := e.Trim(context.Background(), 1); err != nil {
						if !errors.Is(err, ErrClosed) {
							t.Errorf("Trim: %v", err)
						}
						return
					}
				}
			}()
			for count.Load() < 600 && !t.Failed() {
				time.Sleep(time.Millisecond)
			}
			require.NoError(t, e.Close())
			close(stop)
			wg.Wait()

			st := e.Stats()
			checkTally(t, st, &ta)
			require.Equal(t, int64(0), st.InFlightBytes)
			require.Positive(t, st.Outcomes[OutcomeStored])
			require.Positive(t, st.Outcomes[OutcomeLoaded])
			require.Positive(t, st.Outcomes[OutcomeAlreadyPresent])
			require.Equal(t, st.LookupKeys-st.Hits, st.Misses)
			t.Logf("%d ops; outcomes %v; busy loads %d", count.Load(), st.Outcomes, ta.busy)
		})
	}
}
