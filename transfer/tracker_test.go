package transfer_test

import (
	"bytes"
	"fmt"
	"math/rand"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	. "github.com/kvoffload/kvoffload/internal/cudadev"
	. "github.com/kvoffload/kvoffload/transfer"
)

// TestGatingHarness plays the slot owner. Correct gating releases a slot
// only from the op's completion callback; broken gating releases it right
// after Submit, while the copy is still held behind a pending caller event.
// The harness must catch the broken owner (a violation, and poisoned bytes
// loaded) and stay silent for the correct one.
func TestGatingHarness(t *testing.T) {
	if !InvariantsEnabled() {
		t.Skip("gating checks need -race or the kvoinvariants build tag")
	}
	for _, broken := range []bool{false, true} {
		t.Run(fmt.Sprintf("broken=%v", broken), func(t *testing.T) {
			var sim *Sim
			tr := NewTracker(func(addr, n uint64) { require.NoError(t, sim.Fill(addr, n, PoisonByte)) })
			e := newSimEnv(t, 1<<20, Config{Tracker: tr}, SimConfig{Seed: 20, MaxDelay: 50 * time.Microsecond})
			sim = e.sim
			const n = 16 << 10
			data := randBytes(rand.New(rand.NewSource(21)), n)
			require.NoError(t, tr.Live(e.host, n))
			copy(e.hostBuf, data)
			ev, open := e.pendingEvent(t)
			released := make(chan struct{})
			op, err := e.s.Submit(Request{Dir: Load, After: ev, Segments: []Segment{{Dev: e.dev, Host: e.host, Len: n}},
				OnComplete: func(_ *Op, err error) {
					if !broken {
						require.NoError(t, tr.Released(e.host, n))
					}
					close(released)
				}})
			require.NoError(t, err)
			if broken {
				require.NoError(t, tr.Released(e.host, n))
			}
			open()
			require.NoError(t, op.Wait())
			<-released
			got := make([]byte, n)
			require.NoError(t, e.sim.Read(e.dev, got))
			v := tr.Violations()
			if broken {
				require.NotEmpty(t, v, "the harness must catch a slot released before its copy completed")
				require.ErrorIs(t, v[0], ErrInvariant)
				require.Equal(t, bytes.Repeat([]byte{PoisonByte}, n), got, "the load read the poisoned slot")
				// Accept the violation so the env's cleanup check passes.
				tr.ClearViolations()
			} else {
				require.Empty(t, v)
				require.Equal(t, data, got)
			}
		})
	}
}
