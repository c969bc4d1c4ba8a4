package nodepool

import (
	"errors"
	"testing"
	"time"
)

// TestHeadRanges: two clients, the ranks of a TP=2 group, store their
// heads of the same blocks into the same slots; the blocks are visible
// only once both ranges are committed; a third client's store of a range
// being written is present, not a write; a bad range is refused.
func TestHeadRanges(t *testing.T) {
	s := startServer(t, ServerConfig{PoolBytes: 4 << 20, RegionBytes: 1 << 20})
	var cs [3]*Client
	for i := range cs {
		cs[i] = dial(t, s.Addr(), ClientConfig{})
		defer cs[i].Close()
		if !cs[i].WaitRegions(10 * time.Second) {
			t.Fatal("regions not mapped")
		}
	}
	a, b, c := cs[0], cs[1], cs[2]
	keys := testKeys(7, 12)
	store := func(cl *Client, lo, hi int) []StoreResult {
		t.Helper()
		res, err := cl.BeginStore(StoreRequest{Keys: keys, HeadLo: lo, HeadHi: hi}, nil)
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	ra := store(a, 0, 1)
	rb := store(b, 1, 2)
	var sa, sb []Slot
	for i := range keys {
		if ra[i].Outcome != StoreWrite || rb[i].Outcome != StoreWrite {
			t.Fatalf("key %d: outcomes %d and %d, want two writes", i, ra[i].Outcome, rb[i].Outcome)
		}
		if ra[i].Slot.ID != rb[i].Slot.ID {
			t.Fatalf("key %d: the ranks got slots %d and %d, want one", i, ra[i].Slot.ID, rb[i].Slot.ID)
		}
		sa, sb = append(sa, ra[i].Slot), append(sb, rb[i].Slot)
	}
	// A range being written is present to a third writer.
	for i, r := range store(c, 0, 1) {
		if r.Outcome != StorePresent {
			t.Fatalf("key %d: a third store of heads [0, 1): outcome %d, want present", i, r.Outcome)
		}
	}
	if _, err := c.BeginStore(StoreRequest{Keys: keys[:1], HeadLo: 1, HeadHi: 3}, nil); !errors.Is(err, ErrInvalid) {
		t.Fatalf("heads [1, 3) of 2: %v", err)
	}
	if err := a.CommitStore(sa); err != nil {
		t.Fatal(err)
	}
	if h, _, _ := c.Lookup(keys, false, nil); h != 0 {
		t.Fatalf("%d hits with one rank's heads committed", h)
	}
	if err := b.CommitStore(sb); err != nil {
		t.Fatal(err)
	}
	if h, _, _ := c.Lookup(keys, false, nil); h != len(keys) {
		t.Fatalf("%d hits of %d with both ranks' heads committed", h, len(keys))
	}
	// A rank that aborts leaves its blocks partial: never visible.
	keys2 := testKeys(8, 4)
	r2a, err := a.BeginStore(StoreRequest{Keys: keys2, HeadLo: 0, HeadHi: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	r2b, err := b.BeginStore(StoreRequest{Keys: keys2, HeadLo: 1, HeadHi: 2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var s2a, s2b []Slot
	for i := range keys2 {
		s2a, s2b = append(s2a, r2a[i].Slot), append(s2b, r2b[i].Slot)
	}
	if err := a.CommitStore(s2a); err != nil {
		t.Fatal(err)
	}
	if err := b.AbortStore(s2b); err != nil {
		t.Fatal(err)
	}
	if h, _, _ := c.Lookup(keys2, false, nil); h != 0 {
		t.Fatalf("%d hits of blocks a rank aborted", h)
	}
}
