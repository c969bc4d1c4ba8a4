package nodepool

import (
	"errors"
	"testing"
	"time"
)

// TestInProcess: one client stores, another leases and loads the same
// bytes; handles are checked per client.
func TestInProcess(t *testing.T) {
	s := startServer(t, ServerConfig{PoolBytes: 4 << 20, RegionBytes: 1 << 20})
	a := dial(t, s.Addr(), ClientConfig{})
	defer a.Close()
	b := dial(t, s.Addr(), ClientConfig{})
	defer b.Close()
	if !a.WaitRegions(10*time.Second) || !b.WaitRegions(10*time.Second) {
		t.Fatal("regions not mapped")
	}
	if got := a.Info().SlotSize; got != testSlot {
		t.Fatalf("slot size %d", got)
	}
	keys := testKeys(1, 40)
	res, err := a.BeginStore(StoreRequest{Keys: keys}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var slots []Slot
	for i, r := range res {
		if r.Outcome != StoreWrite {
			t.Fatalf("key %d: outcome %d", i, r.Outcome)
		}
		fill(a.SlotBytes(r.Slot), keys[i])
		slots = append(slots, r.Slot)
	}
	// Not ready before the commit.
	if h, _, _ := b.Lookup(keys, false, nil); h != 0 {
		t.Fatalf("%d hits before the commit", h)
	}
	// b cannot commit a's reservation.
	if err := b.CommitStore(slots[:1]); !errors.Is(err, ErrNotYours) {
		t.Fatalf("commit of another's slot: %v", err)
	}
	if err := a.CommitStore(slots); err != nil {
		t.Fatal(err)
	}
	if err := a.CommitStore(slots[:1]); !errors.Is(err, ErrNotYours) {
		t.Fatalf("second commit: %v", err)
	}
	hits, leased, err := b.Lookup(keys, true, nil)
	if err != nil || hits != len(keys) {
		t.Fatalf("lookup: %d hits, %v", hits, err)
	}
	if err := a.Unlease(leased[:1]); !errors.Is(err, ErrNotYours) {
		t.Fatalf("unlease of another's lease: %v", err)
	}
	for i, sl := range leased {
		if err := check(b.SlotBytes(sl), keys[i]); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.Unlease(leased); err != nil {
		t.Fatal(err)
	}
	lr, err := b.BeginLoad(keys[:3], nil)
	if err != nil {
		t.Fatal(err)
	}
	var ends []Slot
	for i, r := range lr {
		if !r.Found {
			t.Fatalf("load %d missing", i)
		}
		ends = append(ends, r.Slot)
	}
	if err := b.EndLoad(ends); err != nil {
		t.Fatal(err)
	}
	st, err := a.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.Cache.Ready != len(keys) || st.Clients != 2 || st.Cache.Leased != 0 {
		t.Fatalf("stats %+v", st)
	}
	if n, err := a.Delete(keys[:5]); err != nil || n != 5 {
		t.Fatalf("delete: %d %v", n, err)
	}
	if n, err := b.Clear(); err != nil || n != len(keys)-5 {
		t.Fatalf("clear: %d %v", n, err)
	}
}

// TestHandshake: another protocol version, another layout for a
// namespace, and a request before Hello are refused with clear errors;
// the node keeps serving.
func TestHandshake(t *testing.T) {
	s := startServer(t, ServerConfig{PoolBytes: 1 << 20})
	a := dial(t, s.Addr(), ClientConfig{})
	defer a.Close()
	other := testLayout
	other.HeadDim = 128
	if _, err := Dial(s.Addr(), ClientConfig{Namespace: "test", Layout: other}); !errors.Is(err, ErrLayout) {
		t.Fatalf("other layout: %v", err)
	}
	// Another namespace with another slot size: one slot size per node.
	if _, err := Dial(s.Addr(), ClientConfig{Namespace: "big", Layout: other}); !errors.Is(err, ErrLayout) {
		t.Fatalf("other slot size: %v", err)
	}
	if err := rawHello(s.Addr(), 99); !errors.Is(err, ErrVersion) {
		t.Fatalf("version 99: %v", err)
	} else {
		t.Log(err)
	}
	if _, err := Dial(s.Addr()+".none", ClientConfig{Layout: testLayout, Redial: -1}); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("no node: %v", err)
	}
	if _, err := a.Stats(); err != nil {
		t.Fatal(err)
	}
}
