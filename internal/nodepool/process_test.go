package nodepool

import (
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// waitStats polls the node until ok holds.
func waitStats(t *testing.T, s *Server, what string, ok func(Stats) bool) Stats {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		st := s.Stats()
		if ok(st) {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: stats %+v", what, st)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestTwoProcesses: one client process writes blocks into its slots and
// commits them; another process leases them and reads the exact bytes.
func TestTwoProcesses(t *testing.T) {
	s := startServer(t, ServerConfig{PoolBytes: 4 << 20})
	if fi, err := os.Stat(s.Addr()); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode: %v %v", fi.Mode(), err)
	}
	w := startChild(t, "writer", s.Addr(), "1 100")
	w.expect(t, "stored 100")
	w.wait(t)
	r := startChild(t, "reader", s.Addr(), "1 100")
	r.expect(t, "verified 100")
	r.wait(t)
	st := waitStats(t, s, "both clients gone", func(st Stats) bool { return st.Clients == 0 })
	if st.ReleasedOnBye != 2 || st.Cache.Ready != 100 || st.Cache.Leased != 0 {
		t.Fatalf("stats %+v", st)
	}
}

// TestKillMidStore: a client SIGKILLed with reservations (half-written
// blocks) and leases: its blocks never become ready, its slots are freed
// only once it exited, and every block another client loads is right.
func TestKillMidStore(t *testing.T) {
	s := startServer(t, ServerConfig{PoolBytes: 4 << 20})
	w := startChild(t, "writer", s.Addr(), "1 50")
	w.expect(t, "stored 50")
	w.wait(t)
	h := startChild(t, "hang", s.Addr(), "2 50")
	h.expect(t, "reserved 50")
	st := s.Stats()
	if st.Cache.Writing != 50 || st.Cache.Leased != 50 {
		t.Fatalf("before the kill: %+v", st.Cache)
	}
	if err := h.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	st = waitStats(t, s, "release on exit", func(st Stats) bool { return st.ReleasedOnExit == 1 })
	if st.Cache.Writing != 0 || st.Cache.Leased != 0 || st.Cache.StoreFailed != 50 || st.Cache.Ready != 50 {
		t.Fatalf("after the kill: %+v", st.Cache)
	}
	r := startChild(t, "reader", s.Addr(), "2 50")
	r.expect(t, "verified 0") // never ready
	r.wait(t)
	r = startChild(t, "reader", s.Addr(), "1 50")
	r.expect(t, "verified 50")
	r.wait(t)
	// The freed slots take a full store of the same keys, read back right.
	w = startChild(t, "writer", s.Addr(), "2 50")
	w.expect(t, "stored 50")
	w.wait(t)
	r = startChild(t, "reader", s.Addr(), "2 50")
	r.expect(t, "verified 50")
	r.wait(t)
}

// TestDisconnectWaitsForExit: a client that closes its connection without
// goodbye but keeps running (its copies may be in flight) keeps its
// reservations and leases until its process exits.
func TestDisconnectWaitsForExit(t *testing.T) {
	s := startServer(t, ServerConfig{PoolBytes: 4 << 20})
	w := startChild(t, "writer", s.Addr(), "1 20")
	w.expect(t, "stored 20")
	w.wait(t)
	d := startChild(t, "drop", s.Addr(), "2 20")
	d.expect(t, "reserved 20")
	time.Sleep(300 * time.Millisecond)
	st := s.Stats()
	if st.Cache.Writing != 20 || st.Cache.Leased != 20 || st.ReleasedOnExit != 0 {
		t.Fatalf("a disconnected, running client's holdings were released: %+v", st)
	}
	_ = d.cmd.Process.Signal(syscall.SIGKILL)
	st = waitStats(t, s, "release on exit", func(st Stats) bool { return st.ReleasedOnExit == 1 })
	if st.Cache.Writing != 0 || st.Cache.Leased != 0 {
		t.Fatalf("after exit: %+v", st.Cache)
	}
}

// TestTrimWithClients: Trim drains regions (a leased block holds its
// region), then every client unmaps them (hook, ack) and the node frees
// them; the rest of the pool keeps serving.
func TestTrimWithClients(t *testing.T) {
	s := startServer(t, ServerConfig{ClientShare: 1, PoolBytes: 4 << 20, RegionBytes: 1 << 20})
	type log struct {
		sync.Mutex
		added, retiring []uint32
	}
	mk := func(l *log) Hooks {
		return Hooks{
			RegionAdded:    func(r *Region) error { l.Lock(); l.added = append(l.added, r.ID); l.Unlock(); return nil },
			RegionRetiring: func(r *Region) { l.Lock(); l.retiring = append(l.retiring, r.ID); l.Unlock() },
		}
	}
	var la, lb log
	a := dial(t, s.Addr(), ClientConfig{Hooks: mk(&la)})
	defer a.Close()
	b := dial(t, s.Addr(), ClientConfig{Hooks: mk(&lb)})
	defer b.Close()
	if !a.WaitRegions(10*time.Second) || !b.WaitRegions(10*time.Second) {
		t.Fatal("regions not mapped")
	}
	keys := testKeys(3, 200) // 64 slots a region: regions 1-3 full, 4 partly
	res, err := a.BeginStore(StoreRequest{Keys: keys}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var slots []Slot
	for i, r := range res {
		if r.Outcome != StoreWrite {
			t.Fatalf("key %d: %d", i, r.Outcome)
		}
		fill(a.SlotBytes(r.Slot), keys[i])
		slots = append(slots, r.Slot)
	}
	if err := a.CommitStore(slots); err != nil {
		t.Fatal(err)
	}
	hits, leased, err := b.Lookup(keys, true, nil)
	if err != nil || hits != 200 {
		t.Fatalf("%d hits, %v", hits, err)
	}
	tr, err := a.Trim(2 << 20)
	if err != nil {
		t.Fatal(err)
	}
	if tr.Regions != 2 || tr.PendingBytes != 2<<20 || tr.FreedBytes != 0 {
		t.Fatalf("trim with leases: %+v", tr)
	}
	lb.Lock()
	n := len(lb.retiring)
	lb.Unlock()
	if n != 0 {
		t.Fatal("a region retired while leased")
	}
	// The leases kept the bytes.
	for i, sl := range leased {
		if err := check(b.SlotBytes(sl), keys[i]); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.Unlease(leased); err != nil {
		t.Fatal(err)
	}
	st := waitStats(t, s, "regions freed", func(st Stats) bool { return st.Regions == 2 && st.FreedBytes == 2<<20 })
	if st.RegionsRetiring != 0 {
		t.Fatalf("stats %+v", st)
	}
	for _, l := range []*log{&la, &lb} {
		l.Lock()
		if fmt.Sprint(l.added) != "[1 2 3 4]" || len(l.retiring) != 2 {
			t.Errorf("hooks: added %v retiring %v", l.added, l.retiring)
		}
		l.Unlock()
	}
	if rs := a.Regions(); len(rs) != 2 || rs[0].ID != 1 || rs[1].ID != 2 {
		t.Fatalf("regions left mapped: %v", rs)
	}
	// What is left serves: 128 slots.
	hits, _, _ = b.Lookup(keys, false, nil)
	more := testKeys(4, 100)
	res, err = a.BeginStore(StoreRequest{Keys: more}, res[:0])
	if err != nil {
		t.Fatal(err)
	}
	slots = slots[:0]
	for _, r := range res {
		if r.Outcome == StoreWrite {
			if r.Slot.Region > 2 {
				t.Fatalf("a slot in retired region %d", r.Slot.Region)
			}
			slots = append(slots, r.Slot)
		}
	}
	if len(slots) != 100 {
		t.Fatalf("%d of 100 stored after the trim (hits before: %d)", len(slots), hits)
	}
	if err := a.CommitStore(slots); err != nil {
		t.Fatal(err)
	}
}

// TestKillChurn: writers SIGKILLed at random points of their stores,
// round after round; every block any client finds is whole, and nothing
// a dead writer held stays held.
func TestKillChurn(t *testing.T) {
	s := startServer(t, ServerConfig{PoolBytes: 4 << 20}) // 256 slots: stores evict
	v := dial(t, s.Addr(), ClientConfig{})
	defer v.Close()
	rng := rand.New(rand.NewPCG(1, 2))
	for round := 0; round < 4; round++ {
		first := 1000 * (round + 1)
		ch := startChild(t, "churn", s.Addr(), fmt.Sprintf("%d 16", first))
		ch.expect(t, "churning")
		time.Sleep(time.Duration(20+rng.IntN(80)) * time.Millisecond)
		_ = ch.cmd.Process.Signal(syscall.SIGKILL)
		_ = ch.cmd.Wait()
		waitStats(t, s, "released", func(st Stats) bool { return st.ReleasedOnExit == uint64(round+1) })
		st := s.Stats()
		if st.Cache.Writing != 0 || st.Cache.Leased != 0 {
			t.Fatalf("round %d: held after exit: %+v", round, st.Cache)
		}
		found := 0
		for sd := first; sd < first+400; sd++ {
			ks := testKeys(sd, 16)
			hits, leased, err := v.Lookup(ks, true, nil)
			if err != nil {
				t.Fatal(err)
			}
			for i, sl := range leased {
				if err := check(v.SlotBytes(sl), ks[i]); err != nil {
					t.Fatalf("round %d seed %d: %v", round, sd, err)
				}
			}
			found += hits
			if err := v.Unlease(leased); err != nil {
				t.Fatal(err)
			}
		}
		t.Logf("round %d: %d blocks found whole, %d store failures so far", round, found, st.Cache.StoreFailed)
	}
}

// pidfds counts this process's open pidfds.
func pidfds(t *testing.T) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if l, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && strings.Contains(l, "pidfd") {
			n++
		}
	}
	return n
}

// TestDroppedConnectionsShareOneWait: connections of one live process
// dropped without goodbye keep their holdings, and the node waits for
// that process with one pidfd, not one per connection.
func TestDroppedConnectionsShareOneWait(t *testing.T) {
	s := startServer(t, ServerConfig{PoolBytes: 1 << 20})
	base := pidfds(t)
	for i := 0; i < 5; i++ {
		c := dial(t, s.Addr(), ClientConfig{Redial: -1})
		if _, err := c.BeginStore(StoreRequest{Keys: testKeys(30+i, 2)}, nil); err != nil {
			t.Fatal(err)
		}
		c.mu.Lock()
		conn := c.conn
		c.mu.Unlock()
		_ = conn.Close() // no goodbye: this process may still be copying
		defer c.Close()
	}
	st := waitStats(t, s, "all five waiting", func(st Stats) bool { return st.WaitingExit == 5 })
	if st.Cache.Writing != 10 {
		t.Fatalf("holdings released while the process lives: %+v", st.Cache)
	}
	if n := pidfds(t) - base; n != 1 {
		t.Fatalf("%d pidfds for one process's five dropped connections", n)
	}
}
