package offload

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// TestOpAndLeaseConcurrentUse backs the documented claim that an Op's and a
// Lease's methods are safe for concurrent use (run under -race): readers of
// one Op race with its completion and with the owner's Release, and several
// goroutines release one Lease, of which exactly one succeeds.
func TestOpAndLeaseConcurrentUse(t *testing.T) {
	defer goleak.VerifyNone(t)
	e := newTestEngine(t, Config{PoolBytes: 64 << 10, Layout: smallLayout(8), Policy: PolicyLRU})
	defer func() { require.NoError(t, e.Close()) }()
	ctx := context.Background()
	keys := e.Keys(make([]uint32, 16*4))
	op, err := e.Store(ctx, keys, []int{0, 1, 2, 3}, StoreOptions{})
	require.NoError(t, err)

	const readers = 4
	var wg sync.WaitGroup
	for range readers {
		wg.Go(func() {
			_ = op.Kind()
			_ = op.Len()
			if err := op.Wait(ctx); err != nil && !errors.Is(err, ErrReleased) {
				t.Errorf("Wait: %v", err)
			}
			<-op.Done()
			if out, err := op.Outcomes(); err == nil {
				if len(out) != len(keys) {
					t.Errorf("Outcomes: %d, want %d", len(out), len(keys))
				}
			} else if !errors.Is(err, ErrReleased) {
				t.Errorf("Outcomes: %v", err)
			}
			_ = op.count(OutcomeStored)
			_ = op.Err()
			_, _ = op.Event()
		})
	}
	wg.Go(func() {
		<-op.Done()
		if err := op.Release(); err != nil {
			t.Errorf("Release: %v", err)
		}
	})
	wg.Wait()
	require.ErrorIs(t, op.Release(), ErrReleased)

	res, err := e.Lookup(keys, LookupOptions{Lease: true})
	require.NoError(t, err)
	require.Equal(t, len(keys), res.Hits)
	var ok atomic.Int32
	for range readers {
		wg.Go(func() {
			if n := len(res.Lease.leasedKeys()); n != len(keys) {
				t.Errorf("Lease.Keys: %d, want %d", n, len(keys))
			}
			switch err := res.Lease.Release(); {
			case err == nil:
				ok.Add(1)
			case !errors.Is(err, ErrReleased):
				t.Errorf("Lease.Release: %v", err)
			}
		})
	}
	wg.Wait()
	require.Equal(t, int32(1), ok.Load(), "exactly one Release of a lease succeeds")
	require.Zero(t, e.Stats().Pool.BlocksLeased)
}
