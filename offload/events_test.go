package offload

import (
	"context"
	"errors"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// eventTokens are the token ids the events tests store with key i.
func eventTokens(i, perBlock int) []uint32 {
	out := make([]uint32, perBlock)
	for j := range out {
		out[j] = uint32(i*perBlock + j)
	}
	return out
}

func drainEvents(s *EventStream) []Event {
	var out []Event
	for ev := range s.C {
		out = append(out, ev)
	}
	return out
}

// TestEventsAgreeWithStats runs concurrent stores (with parents and
// tokens), loads and lookups over more keys than the pool holds, so the
// policy evicts, then deletes, clears and closes, and checks that the
// event streams are views of what Stats counts: as many EventStored as
// OutcomeStored, as many EventRemoved as evictions plus deletes, each
// key's events alternating stored/removed from a store, the replayed index
// equal to what Lookup finds, and a slow stream's losses all counted by
// Dropped.
func TestEventsAgreeWithStats(t *testing.T) {
	defer goleak.VerifyNone(t)
	const blocks, universe, workers, opsPer = 32, 96, 4, 300
	e := newTestEngine(t, Config{PoolBytes: 16 * 8192, Layout: smallLayout(blocks), Namespace: "m"})
	tpb := e.cfg.Layout.TokensPerBlock
	all := e.Events(1 << 20)
	slow := e.Events(4)

	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(7, uint64(w)))
			ids := []int{w * 8, w*8 + 1, w*8 + 2, w*8 + 3}
			for range opsPer {
				first := rng.IntN(universe - 4)
				n := 1 + rng.IntN(4)
				keys := make([]Key, n)
				var tokens []uint32
				for j := range keys {
					keys[j] = testKey(first + j)
					tokens = append(tokens, eventTokens(first+j, tpb)...)
				}
				var parent Key
				if first > 0 {
					parent = testKey(first - 1)
				}
				switch r := rng.IntN(10); {
				case r < 5:
					op, err := e.Store(context.Background(), keys, ids[:n], StoreOptions{Parent: parent, Tokens: tokens})
					if err == nil {
						err = op.Wait(context.Background())
						_ = op.Release()
					}
					if err != nil {
						t.Errorf("store: %v", err)
					}
				case r < 9:
					op, err := e.Load(context.Background(), keys, ids[:n], LoadOptions{})
					if errors.Is(err, ErrBusy) {
						continue
					}
					if err == nil {
						err = op.Wait(context.Background())
						_ = op.Release()
					}
					if err != nil {
						t.Errorf("load: %v", err)
					}
				default:
					if _, err := e.Lookup(keys, LookupOptions{}); err != nil {
						t.Errorf("lookup: %v", err)
					}
				}
				runtime.Gosched()
			}
		})
	}
	wg.Wait()

	// A bad Tokens length is refused before anything is reserved.
	_, err := e.Store(context.Background(), []Key{testKey(0)}, []int{0}, StoreOptions{Tokens: []uint32{1}})
	require.ErrorIs(t, err, ErrInvalidArgument)

	// Every op is done: deletes and the clear find only ready blocks.
	_, err = e.Delete([]Key{testKey(1), testKey(2), testKey(3)})
	require.NoError(t, err)
	present := map[Key]bool{}
	for i := range universe {
		res, err := e.Lookup([]Key{testKey(i)}, LookupOptions{})
		require.NoError(t, err)
		if res.Hits == 1 {
			present[testKey(i)] = true
		}
	}
	half := len(present) / 2
	var del []Key
	for k := range present {
		if len(del) < half {
			del = append(del, k)
		}
	}
	_, err = e.Delete(del)
	require.NoError(t, err)
	for _, k := range del {
		delete(present, k)
	}
	st := e.Stats()
	require.NoError(t, e.Close())

	evs := drainEvents(all)
	got := drainEvents(slow)
	require.Zero(t, all.Dropped(), "the large stream lost nothing")
	require.Equal(t, EventCleared, evs[len(evs)-1].Kind, "Close ends the stream with AllBlocksCleared")
	require.Equal(t, int64(len(evs)), int64(len(got))+slow.Dropped(), "the slow stream's losses are all counted")

	var stored, removed int64
	state := map[Key]bool{}
	for _, ev := range evs[:len(evs)-1] {
		require.Equal(t, MediumCPU, ev.Medium)
		require.Equal(t, tpb, ev.BlockSize)
		switch ev.Kind {
		case EventStored:
			stored++
			require.False(t, state[ev.Key], "key %v stored twice without a removal between", ev.Key)
			state[ev.Key] = true
			idx := -1
			for j := range universe {
				if testKey(j) == ev.Key {
					idx = j
					break
				}
			}
			require.GreaterOrEqual(t, idx, 0)
			require.Equal(t, eventTokens(idx, tpb), ev.Tokens, "the block's tokens")
			if idx > 0 {
				require.Equal(t, testKey(idx-1), ev.Parent, "the block's parent")
			} else {
				require.Equal(t, Key{}, ev.Parent)
			}
		case EventRemoved:
			removed++
			require.True(t, state[ev.Key], "key %v removed before it was stored", ev.Key)
			state[ev.Key] = false
		default:
			t.Fatalf("unexpected %v before the end", ev.Kind)
		}
	}
	for k, in := range state {
		if !in {
			delete(state, k)
		}
	}
	require.Equal(t, present, state, "replaying the events gives the index Lookup saw")
	require.Positive(t, st.Evictions, "the run evicted")
	require.Equal(t, st.Outcome(OutcomeStored), stored, "EventStored = OutcomeStored")
	require.Equal(t, st.Evictions+st.Deletes, removed, "EventRemoved = evictions + deletes")
}

// TestEventsStreamClose covers a stream closed by its reader and one asked
// for after Close.
func TestEventsStreamClose(t *testing.T) {
	defer goleak.VerifyNone(t)
	e := newTestEngine(t, Config{PoolBytes: 64 << 10, Layout: smallLayout(8)})
	s := e.Events(0)
	s.Close()
	s.Close()
	_, open := <-s.C
	require.False(t, open)
	keys := e.Keys(make([]uint32, 16))
	op, err := e.Store(context.Background(), keys, []int{0}, StoreOptions{})
	require.NoError(t, err)
	require.NoError(t, op.Wait(context.Background()))
	require.NoError(t, op.Release())
	require.NoError(t, e.Close())
	late := e.Events(1)
	_, open = <-late.C
	require.False(t, open)
	require.Equal(t, "BlockStored", EventStored.String())
	require.Equal(t, "EventKind(9)", EventKind(9).String())
}
