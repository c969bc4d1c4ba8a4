package offload

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvoffload/kvoffload/internal/cudadev"
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
	for _, policy := range []Policy{PolicyLRU, PolicyTinyLFU} {
		t.Run(string(policy), func(t *testing.T) {
			sim, err := cudadev.NewSim(cudadev.SimConfig{Seed: 7, MaxDelay: 200 * time.Microsecond})
			require.NoError(t, err)
			defer func() { require.NoError(t, sim.Close()) }()
			slot := int64(8 << 10)
			e := newEngineOn(t, Config{PoolBytes: 24 * slot, FirstRegionBytes: 8 * slot, RegionBytes: 8 * slot,
				Layout: simLayout(t, sim, 48), Policy: policy, MaxInFlightBytes: 4 * slot, MaxQueuedBytes: 16 * slot}, sim)
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
				// The pool grows to its three regions first: a Trim that
				// came before growth (a loaded machine) would give back the
				// only region and, lowering the target, leave no pool.
				if err := e.WaitGrown(context.Background()); err != nil {
					if !errors.Is(err, ErrClosed) {
						t.Errorf("WaitGrown: %v", err)
					}
					return
				}
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
			// Close lands in the middle of the workers' ops: after at least
			// minOps, and once a load has found its block and a store its
			// key present, so that the checks below never run on a
			// schedule that left them nothing to check (the device's
			// progress against the workers' is the scheduler's choice).
			// maxOps and maxWait bound the wait should the engine, or the
			// workers, stop making progress; the assertions below then
			// report it.
			const minOps, maxOps, maxWait = 600, 100 * 600, time.Minute
			deadline := time.Now().Add(maxWait)
			for n := count.Load(); n < maxOps && !t.Failed() && time.Now().Before(deadline); n = count.Load() {
				out := e.Stats().Outcomes
				if n >= minOps && out[OutcomeLoaded] > 0 && out[OutcomeAlreadyPresent] > 0 {
					break
				}
				time.Sleep(time.Millisecond)
			}
			cs := e.cache.Stats()
			require.NoError(t, e.Close())
			close(stop)
			wg.Wait()

			st := e.Stats()
			checkTally(t, st, &ta)
			require.Equal(t, int64(0), st.Copies.InFlightBytes)
			pool := fmt.Sprintf("%d ops; outcomes %v; busy loads %d; pool before Close: %d slots, %d free, %d writing, %d ready, %d leased, %d releasing",
				count.Load(), st.Outcomes, ta.busy, cs.Slots, cs.Free, cs.Writing, cs.Ready, cs.Leased, cs.Releasing)
			require.Positive(t, st.Outcomes[OutcomeStored], pool)
			require.Positive(t, st.Outcomes[OutcomeLoaded], pool)
			require.Positive(t, st.Outcomes[OutcomeAlreadyPresent], pool)
			require.Equal(t, st.LookupKeys-st.Hits, st.Misses)
			t.Log(pool)
		})
	}
}

// TestPoolFullOfDeletedWritesRecovers replays, deterministically, the
// schedule that made TestStressCloseInTheMiddle see "pool full, nothing
// found" when the workers outran the copies: every slot holds a store
// still in flight, two Trims take regions away from under them, and the
// keys are deleted before their copies complete. Stores are then refused
// as pool full and loads miss, as they must (no slot is free and none
// holds a block that may be evicted or read); once the copies complete,
// every slot comes back, the trimmed regions are released, and the pool
// stores and loads again.
func TestPoolFullOfDeletedWritesRecovers(t *testing.T) {
	defer goleak.VerifyNone(t)
	for _, policy := range []Policy{PolicyLRU, PolicyTinyLFU} {
		t.Run(string(policy), func(t *testing.T) {
			sim, err := cudadev.NewSim(cudadev.SimConfig{})
			require.NoError(t, err)
			defer func() { require.NoError(t, sim.Close()) }()
			slot := int64(8 << 10)
			e := newEngineOn(t, Config{PoolBytes: 24 * slot, FirstRegionBytes: 8 * slot, RegionBytes: 8 * slot,
				Layout: simLayout(t, sim, 48), Policy: policy}, sim)
			defer func() { require.NoError(t, e.Close()) }()
			require.NoError(t, e.WaitGrown(context.Background()))
			require.Equal(t, 24, e.cache.Stats().Slots)

			// The stores wait on an event recorded on a stream held at a
			// gate: their copies stay in flight until it opens.
			ev, cs, gate := gatedEvent(t, sim)
			defer gate()
			var keys []Key
			var ops []*Op
			for i := range 6 {
				chain := []Key{testKey(4 * i), testKey(4*i + 1), testKey(4*i + 2), testKey(4*i + 3)}
				ids := []int{4 * i, 4*i + 1, 4*i + 2, 4*i + 3}
				for j, k := range chain {
					writeBlock(t, e, ids[j], keyContent(k, slot))
				}
				op, err := e.Store(context.Background(), chain, ids, StoreOptions{After: uintptr(ev), AfterStream: uintptr(cs)})
				require.NoError(t, err)
				keys, ops = append(keys, chain...), append(ops, op)
			}
			st := e.cache.Stats()
			require.Equal(t, [2]int{0, 24}, [2]int{st.Free, st.Writing}, "every slot holds a store in flight")

			cancelled, cancel := context.WithCancel(context.Background())
			cancel()
			for range 2 {
				res, err := e.Trim(cancelled, 1)
				require.NoError(t, err)
				require.Equal(t, TrimResult{RequestedBytes: 1, PendingBytes: 8 * slot, Regions: 1, EvictedBlocks: 8}, res)
			}
			n, err := e.Delete(keys)
			require.NoError(t, err)
			require.Equal(t, 8, n, "the stores left in the remaining region are deleted while being written")

			st = e.cache.Stats()
			require.Equal(t, [5]int{8, 0, 0, 0, 24}, [5]int{st.Slots, st.Free, st.Writing, st.Ready, st.Releasing},
				"8 usable slots, each releasing once its copy completes")
			op, err := e.Store(context.Background(), []Key{testKey(100)}, []int{40}, StoreOptions{})
			require.NoError(t, err)
			require.Equal(t, []Outcome{OutcomeRefusedFull}, mustOutcomes(op.Outcomes()))
			require.NoError(t, op.Release())
			op, err = e.Load(context.Background(), keys[:4], []int{40, 41, 42, 43}, LoadOptions{})
			require.NoError(t, err)
			require.NoError(t, op.Wait(context.Background()))
			require.Equal(t, []Outcome{OutcomeMissing, OutcomeMissing, OutcomeMissing, OutcomeMissing}, mustOutcomes(op.Outcomes()))
			require.NoError(t, op.Release())

			gate()
			for _, op := range ops {
				require.NoError(t, op.Wait(context.Background()))
				require.Equal(t, []Outcome{OutcomeStored, OutcomeStored, OutcomeStored, OutcomeStored}, mustOutcomes(op.Outcomes()))
				require.NoError(t, op.Release())
			}
			require.Eventually(t, func() bool { return drained(e) }, 10*time.Second, time.Millisecond)
			st = e.cache.Stats()
			require.Equal(t, [5]int{8, 8, 0, 0, 0}, [5]int{st.Slots, st.Free, st.Writing, st.Ready, st.Releasing},
				"every slot is free again")
			require.Equal(t, 8*slot, e.Stats().Pool.OwnedBytes)

			fresh := []Key{testKey(200), testKey(201), testKey(202), testKey(203)}
			for j, k := range fresh {
				writeBlock(t, e, 40+j, keyContent(k, slot))
			}
			op, err = e.Store(context.Background(), fresh, []int{40, 41, 42, 43}, StoreOptions{})
			require.NoError(t, err)
			require.NoError(t, op.Wait(context.Background()))
			require.Equal(t, []Outcome{OutcomeStored, OutcomeStored, OutcomeStored, OutcomeStored}, mustOutcomes(op.Outcomes()))
			require.NoError(t, op.Release())
			ids := []int{44, 45, 46, 47}
			op, err = e.Load(context.Background(), fresh, ids, LoadOptions{})
			require.NoError(t, err)
			require.NoError(t, op.Wait(context.Background()))
			require.Equal(t, []Outcome{OutcomeLoaded, OutcomeLoaded, OutcomeLoaded, OutcomeLoaded}, mustOutcomes(op.Outcomes()))
			require.NoError(t, op.Release())
			for j, k := range fresh {
				require.Equal(t, keyContent(k, slot), blockBytes(e, ids[j]), "block %d", ids[j])
			}
		})
	}
}
