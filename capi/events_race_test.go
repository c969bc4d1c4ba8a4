//go:build cgo

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/offload"
	"github.com/kvoffload/kvoffload/offload/hostsim"
)

// raceConfig is a small host-backend engine for the race tests.
const raceConfig = `{"pool_bytes": 1048576, "backend": "host", "skip_memory_check": true, "staging_bytes": -1,
 "namespace": "events-race", "layout": {"kind": "layer-separate", "layers": 2, "kv_heads": 2, "head_dim": 8,
 "dtype_bytes": 2, "tokens_per_block": 4, "num_blocks": 16}}`

// raceCall runs one event or destroy call and sorts its result: nil, a
// documented outcome of racing a close or destroy (the engine destroyed:
// KVO_ECLOSED; no stream, or one already open: KVO_EINVAL), or anything
// else (a panic included), which is sent to bad. It reports whether the
// engine handle was found destroyed.
func raceCall(bad chan<- error, name string, f func() error) (destroyed bool) {
	defer func() {
		if p := recover(); p != nil {
			bad <- fmt.Errorf("%s panicked: %v", name, p)
			destroyed = true
		}
	}()
	err := f()
	switch {
	case err == nil:
		return false
	case errors.Is(err, errEngineStale) && code(err) == codeClosed:
		return true
	case (errors.Is(err, errNoStream) || errors.Is(err, errStreamOpen)) && code(err) == codeInval:
		return false
	}
	bad <- fmt.Errorf("%s: %v (code %d)", name, err, int(code(err)))
	return true
}

// requireDestroyed checks that e, taken from a destroyed handle h, was
// destroyed whole: no handle, no event stream, the engine closed, the
// simulated GPU closed.
func requireDestroyed(t *testing.T, h uint64, e *engineEntry) {
	t.Helper()
	_, err := engines.get(h)
	require.ErrorIs(t, err, errStale)
	_, ok := eventSubs.Load(h)
	require.False(t, ok, "no event stream outlives engine %#x", h)
	_, err = e.eng.Lookup([]offload.Key{{1}}, offload.LookupOptions{})
	require.ErrorIs(t, err, offload.ErrClosed, "the engine is closed")
	_, err = e.sim.Alloc(4096)
	require.ErrorContains(t, err, "DEINITIALIZED", "the simulated GPU is closed")
}

// TestEventsRaceDestroy: kvo_events_open, poll, dropped and close on
// several threads racing kvo_events_close and kvo_engine_destroy, round
// after round (run it with -race): no call panics or fails otherwise than
// as documented (KVO_ECLOSED once destroyed; KVO_EINVAL for no stream or
// one already open), every destroy succeeds, and every engine is
// destroyed whole (closed, its stream dropped, its simulated GPU closed).
func TestEventsRaceDestroy(t *testing.T) {
	rounds := 300
	if testing.Short() {
		rounds = 50
	}
	bad := make(chan error, 64)
	rng := rand.New(rand.NewPCG(52, 3))
	for r := range rounds {
		h, err := createEngine(raceConfig, hostsim.NewEngine)
		require.NoError(t, err)
		e, err := engines.get(h)
		require.NoError(t, err)
		var (
			wg      sync.WaitGroup
			calls   atomic.Int64
			opened  atomic.Int64
			started = make(chan struct{})
		)
		loop := func(body func() bool) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-started
				for body() {
					calls.Add(1)
					runtime.Gosched()
				}
			}()
		}
		// An opener, two pollers and a closer on the handle.
		loop(func() bool {
			done := raceCall(bad, "kvo_events_open", func() error {
				err := eventsOpen(h, int64(rand.IntN(8)))
				if err == nil {
					opened.Add(1)
				}
				return err
			})
			return !done
		})
		for range 2 {
			loop(func() bool {
				done := raceCall(bad, "kvo_events_poll", func() error {
					return eventsPoll(h, func(b []byte) bool {
						var evs []map[string]any
						if err := json.Unmarshal(b, &evs); err != nil {
							bad <- fmt.Errorf("kvo_events_poll wrote %q: %v", b, err)
						}
						return true
					})
				})
				done = raceCall(bad, "kvo_events_dropped", func() error { _, err := eventsDropped(h, true); return err }) || done
				return !done
			})
		}
		loop(func() bool { return !raceCall(bad, "kvo_events_close", func() error { return eventsClose(h) }) })
		// Some events to poll: a store on the engine while it lives.
		loop(func() bool {
			return !raceCall(bad, "store", func() error {
				op, err := e.eng.Store(context.Background(), []offload.Key{{byte(r), byte(rand.IntN(200)), 1}}, []int{0}, offload.StoreOptions{})
				if err != nil {
					if errors.Is(err, offload.ErrClosed) {
						return fmt.Errorf("%w (%w)", err, errEngineStale)
					}
					return err
				}
				_ = op.Wait(context.Background())
				return op.Release()
			})
		})
		close(started)
		// Destroy at a random point of the others' loops.
		time.Sleep(time.Duration(rng.IntN(300)) * time.Microsecond)
		var derr error
		raceCall(bad, "kvo_engine_destroy", func() error { derr = destroyEngine(h); return derr })
		require.NoError(t, derr, "round %d: destroy", r)
		wg.Wait()
		select {
		case err := <-bad:
			t.Fatalf("round %d (%d calls, %d opens): %v", r, calls.Load(), opened.Load(), err)
		default:
		}
		requireDestroyed(t, h, e)
		err = destroyEngine(h)
		require.ErrorIs(t, err, errEngineStale, "a second destroy")
		require.Equal(t, codeClosed, int(code(err)))
	}
}

// TestDestroyCompletesAfterAFailedStep: a step of kvo_engine_destroy that
// fails (a panic, injected at the end of each step in turn) is reported
// (KVO_EFAIL), and every step after it still runs: the handle is gone,
// the engine closed, the stream dropped, the simulated GPU closed.
func TestDestroyCompletesAfterAFailedStep(t *testing.T) {
	defer func() { destroyStepHook = nil }()
	for _, failing := range []string{"closing the engine", "dropping the event stream", "closing the simulated GPU"} {
		t.Run(strings.ReplaceAll(failing, " ", "-"), func(t *testing.T) {
			h, err := createEngine(raceConfig, hostsim.NewEngine)
			require.NoError(t, err)
			e, err := engines.get(h)
			require.NoError(t, err)
			require.NoError(t, eventsOpen(h, 0))
			var ran []string
			destroyStepHook = func(step string) {
				ran = append(ran, step)
				if step == failing {
					panic("injected")
				}
			}
			err = destroyEngine(h)
			destroyStepHook = nil
			require.ErrorContains(t, err, failing+": internal error (panic): injected")
			require.Equal(t, codeFail, int(code(err)))
			require.Equal(t, []string{"closing the engine", "dropping the event stream", "closing the simulated GPU"}, ran, "every step ran")
			requireDestroyed(t, h, e)
		})
	}
}
