package offload

import (
	"context"
	"errors"
	"testing"
)

// FuzzStoreLoadArgs feeds Store and Load arbitrary key and block id lists
// (lengths that differ, ids outside the layout or negative, duplicates):
// either the call returns ErrInvalidArgument and nothing changed, or it
// returns an op whose every block gets exactly one final outcome.
func FuzzStoreLoadArgs(f *testing.F) {
	f.Add([]byte{2, 2, 0, 1, 7, 9}, true)
	f.Add([]byte{2, 1, 0, 0, 7}, false)
	f.Add([]byte{1, 1, 8, 3}, true)
	f.Add([]byte{3, 3, 1, 1, 2, 4, 4, 5}, true)
	f.Add([]byte{1, 1, 200, 1}, false)
	e, err := newEngine(Config{PoolBytes: 64 << 10, Layout: smallLayout(8), Policy: PolicyLRU, Backend: BackendHost, SkipMemoryCheck: true}, engineHooks{})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = e.Close() })
	f.Fuzz(func(t *testing.T, data []byte, store bool) {
		if len(data) < 2 {
			return
		}
		nk, nb := int(data[0]%6), int(data[1]%6)
		data = data[2:]
		ids := make([]int, 0, nb)
		for i := 0; i < nb && i < len(data); i++ {
			ids = append(ids, int(int8(data[i]))%12)
		}
		keys := make([]Key, 0, nk)
		for i := 0; i < nk; i++ {
			b := 0
			if len(data) > 0 {
				b = int(data[(nb+i)%len(data)] % 4)
			}
			keys = append(keys, testKey(b))
		}
		before := stateOf(e)
		var op *Op
		if store {
			op, err = e.Store(context.Background(), keys, ids, StoreOptions{})
		} else {
			op, err = e.Load(context.Background(), keys, ids, LoadOptions{})
		}
		if err != nil {
			if !errors.Is(err, ErrInvalidArgument) {
				t.Fatalf("keys %v ids %v: error %v does not wrap ErrInvalidArgument", keys, ids, err)
			}
			if after := stateOf(e); after != before {
				t.Fatalf("refused call changed the state: %+v → %+v", before, after)
			}
			return
		}
		if err := op.Wait(context.Background()); err != nil {
			t.Fatal(err)
		}
		out, err := op.Outcomes()
		if err != nil || len(out) != len(keys) {
			t.Fatalf("outcomes %v (%v) for %d keys", out, err, len(keys))
		}
		for i, oc := range out {
			if oc == OutcomePending || oc >= numOutcomes {
				t.Fatalf("block %d: outcome %v", i, oc)
			}
		}
		if err := op.Release(); err != nil {
			t.Fatal(err)
		}
	})
}
