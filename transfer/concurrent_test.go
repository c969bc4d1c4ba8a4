package transfer_test

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	. "github.com/kvoffload/kvoffload/internal/cudadev"
	. "github.com/kvoffload/kvoffload/transfer"
)

// TestOpConcurrentUse backs the documented claim that an Op's methods are
// safe for concurrent use (run under -race): readers of one op race with its
// completion and with the owner's Release after Done.
func TestOpConcurrentUse(t *testing.T) {
	e := newSimEnv(t, 64<<10, Config{}, SimConfig{Seed: 3, MaxDelay: 200 * time.Microsecond})
	segs := []Segment{{Dev: e.dev, Host: e.host, Len: 16 << 10}, {Dev: e.dev + 32<<10, Host: e.host + 32<<10, Len: 16 << 10}}
	op, err := e.s.Submit(Request{Dir: Store, Segments: segs})
	require.NoError(t, err)
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			_, _, _ = op.Dir(), op.Bytes(), op.Layers()
			if err := op.Wait(); err != nil && !errors.Is(err, ErrReleased) {
				t.Errorf("Wait: %v", err)
			}
			<-op.Done()
			if err := op.Err(); err != nil && !errors.Is(err, ErrReleased) {
				t.Errorf("Err: %v", err)
			}
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
}
