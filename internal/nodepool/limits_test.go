package nodepool

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"testing/fstest"
	"time"

	"github.com/kvoffload/kvoffload/internal/memfit"
	"github.com/kvoffload/kvoffload/internal/nodepool/wire"
	"github.com/kvoffload/kvoffload/kvcache"
)

// fakeSystem is a machine of injected readings: /proc and /sys files.
func fakeSystem(files map[string]string) memfit.System {
	m := fstest.MapFS{}
	for p, c := range files {
		m[p] = &fstest.MapFile{Data: []byte(c)}
	}
	return memfit.System{FS: m, Memlock: func() (uint64, error) { return math.MaxUint64, nil }}
}

// TestPoolSizedUpFront (issue 52 item 2): the whole pool is checked
// against MemAvailable and the memory cgroup's limit before anything is
// mapped or bound, with an error naming the limit; a context that ends
// while the pool is mapped stops it between regions and unmaps what was
// mapped.
func TestPoolSizedUpFront(t *testing.T) {
	const gib = int64(1) << 30
	meminfo := "MemTotal: 24117248 kB\nMemAvailable: 23068672 kB\n" // 22 GiB available
	for _, tc := range []struct {
		name  string
		files map[string]string
		pool  int64
		want  string
	}{
		{"MemAvailable", map[string]string{"proc/meminfo": meminfo}, 200 * gib, "MemAvailable in /proc/meminfo allows 23622320128 bytes"},
		{"cgroup", map[string]string{"proc/meminfo": meminfo, "proc/self/cgroup": "0::/job\n",
			"sys/fs/cgroup/job/memory.max": "1073741824\n", "sys/fs/cgroup/job/memory.current": "0\n"},
			2 * gib, "the cgroup limit /sys/fs/cgroup/job/memory.max (minus usage) allows 1073741824 bytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sock := filepath.Join(t.TempDir(), "node.sock")
			mapped := 0
			_, err := newServer(context.Background(), ServerConfig{Socket: sock, PoolBytes: tc.pool, NoPrefault: true},
				fakeSystem(tc.files), func(uint32) { mapped++ })
			if !errors.Is(err, ErrInsufficientMemory) || !strings.Contains(err.Error(), tc.want) ||
				!strings.Contains(err.Error(), fmt.Sprint(tc.pool)) {
				t.Fatalf("pool of %d bytes: %v, want ErrInsufficientMemory naming %q", tc.pool, err, tc.want)
			}
			if mapped != 0 {
				t.Fatalf("%d regions mapped before the refusal", mapped)
			}
			if _, err := os.Lstat(sock); err == nil {
				t.Fatal("the socket was bound")
			}
		})
	}
	// With HugeTLB, the free huge pages count: 4 MiB of them hold a 4 MiB
	// pool that MemAvailable (1 MiB) would not; without, it is refused.
	small := map[string]string{"proc/meminfo": "MemAvailable: 1024 kB\nHugePages_Free: 2\nHugepagesize: 2048 kB\n"}
	cfg := ServerConfig{Socket: filepath.Join(t.TempDir(), "node.sock"), PoolBytes: 4 << 20, HugeTLB: true, NoPrefault: true}
	s, err := newServer(context.Background(), cfg, fakeSystem(small), nil)
	if err != nil {
		t.Fatalf("a pool the free huge pages hold: %v", err)
	}
	_ = s.Close()
	cfg.HugeTLB = false
	if _, err := newServer(context.Background(), cfg, fakeSystem(small), nil); !errors.Is(err, ErrInsufficientMemory) {
		t.Fatalf("4 MiB of base pages with 1 MiB available: %v", err)
	}
	// Stopped between regions: what was mapped is unmapped, the lock is
	// free again.
	sock := filepath.Join(t.TempDir(), "node.sock")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var seen []uint32
	_, err = newServer(ctx, ServerConfig{Socket: sock, PoolBytes: 8 << 20, RegionBytes: 1 << 20, NoPrefault: true},
		fakeSystem(map[string]string{"proc/meminfo": meminfo}), func(id uint32) {
			seen = append(seen, id)
			if id == 3 {
				cancel()
			}
		})
	if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "after 2097152 of 8388608 bytes") {
		t.Fatalf("canceled at region 3: %v", err)
	}
	if len(seen) != 3 {
		t.Fatalf("regions begun: %v, want 1 2 3", seen)
	}
	s = startServer(t, ServerConfig{Socket: sock, PoolBytes: 1 << 20})
	dialMapped(t, s)
}

// TestSocketPathLimit (issue 52 item 7): a path longer than a unix socket
// address holds is refused, naming its length and the limit; the longest
// that fits is served.
func TestSocketPathLimit(t *testing.T) {
	dir := t.TempDir()
	name := func(n int) string {
		return filepath.Join(dir, strings.Repeat("s", n-len(dir)-1))
	}
	long := name(MaxSocketPath + 1)
	_, err := NewServer(ServerConfig{Socket: long, PoolBytes: 1 << 20, NoPrefault: true})
	if err == nil || !strings.Contains(err.Error(), "is 108 bytes, at most 107") || !strings.Contains(err.Error(), "108 bytes, its terminating NUL") {
		t.Fatalf("a 108-byte path: %v", err)
	}
	if _, err := os.Lstat(long); err == nil {
		t.Fatal("the long path was bound")
	}
	s := startServer(t, ServerConfig{Socket: name(MaxSocketPath), PoolBytes: 1 << 20})
	dialMapped(t, s)
}

// TestOneNodePerSocket (issue 52 item 6): of nodes started at once on one
// path exactly one listens, the others are refused naming the lock; a node
// stopping removes the socket only if it is still the one it bound.
func TestOneNodePerSocket(t *testing.T) {
	for round := range 5 {
		sock := filepath.Join(t.TempDir(), "node.sock")
		const n = 12
		var wg sync.WaitGroup
		servers := make([]*Server, n)
		errs := make([]error, n)
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				servers[i], errs[i] = NewServer(ServerConfig{Socket: sock, PoolBytes: 1 << 20, NoPrefault: true})
			}()
		}
		wg.Wait()
		var winner *Server
		for i, s := range servers {
			if s == nil {
				if !strings.Contains(errs[i].Error(), "a node already") {
					t.Fatalf("round %d: a loser's error: %v", round, errs[i])
				}
				continue
			}
			if winner != nil {
				t.Fatalf("round %d: two nodes listen on %s", round, sock)
			}
			winner = s
		}
		if winner == nil {
			t.Fatalf("round %d: no node listens: %v", round, errs)
		}
		go func() { _ = winner.Serve() }()
		c := dial(t, sock, ClientConfig{NoMap: true})
		_ = c.Close()
		// The winner's socket replaced by another's (removed by hand, a
		// new one bound): stopping the winner leaves it.
		if err := os.Remove(sock); err != nil {
			t.Fatal(err)
		}
		other, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: sock, Net: "unixpacket"})
		if err != nil {
			t.Fatal(err)
		}
		other.SetUnlinkOnClose(false)
		_ = winner.Close()
		if _, err := os.Lstat(sock); err != nil {
			t.Fatalf("round %d: stopping the node removed another's socket: %v", round, err)
		}
		_ = other.Close()
	}
}

// hogSeed is the hog child's keys' seed.
const hogSeed = 40

// TestClientShare (issue 52 item 4): a client process holds at most its
// share of the pool's slots, its reservations and leases together, and a
// client within its share is never refused full because of it.
func TestClientShare(t *testing.T) {
	const slots = 64
	s := startServer(t, ServerConfig{PoolBytes: slots * testSlot, RegionBytes: slots * testSlot})
	// The hog (another process) stores, leases and reserves all it can.
	hog := startChild(t, "hog", s.Addr(), fmt.Sprintf("%d %d", hogSeed, slots))
	line := hog.expect(t, "hogging")
	var committed, leased, reserved int
	if _, err := fmt.Sscanf(line, "hogging %d %d %d", &committed, &leased, &reserved); err != nil {
		t.Fatal(line, err)
	}
	share := int(s.Stats().ShareSlots)
	if share != slots/2 || leased+reserved > share || leased+reserved < share-1 {
		t.Fatalf("the hog holds %d leased and %d reserved slots; its share is %d of %d", leased, reserved, share, slots)
	}
	// Another client within its share: every store written, every load
	// found and byte-exact, round after round.
	c := dialMapped(t, s)
	for round := range 20 {
		keys := testKeys(round, share/4)
		res, err := c.BeginStore(StoreRequest{Keys: keys}, nil)
		if err != nil {
			t.Fatal(err)
		}
		var slotsW []Slot
		for i, r := range res {
			if r.Outcome != StoreWrite {
				t.Fatalf("round %d key %d: outcome %d with the hog at its share", round, i, r.Outcome)
			}
			fill(c.SlotBytes(r.Slot), keys[i])
			slotsW = append(slotsW, r.Slot)
		}
		if err := c.CommitStore(slotsW); err != nil {
			t.Fatal(err)
		}
		lr, err := c.BeginLoad(keys, nil)
		if err != nil {
			t.Fatal(err)
		}
		var ends []Slot
		for i, r := range lr {
			if !r.Found {
				t.Fatalf("round %d key %d: not found", round, i)
			}
			if err := check(c.SlotBytes(r.Slot), keys[i]); err != nil {
				t.Fatal(err)
			}
			ends = append(ends, r.Slot)
		}
		if err := c.EndLoad(ends); err != nil {
			t.Fatal(err)
		}
	}
	if st := s.Stats(); st.OverShare == 0 {
		t.Fatalf("the hog was never held to its share: %+v", st)
	}
}

// TestReserveTimeout (issue 52 item 4): a reservation not committed within
// ReserveTimeout expires: its slot goes back to the pool, the block never
// becomes ready, and a late commit is refused.
func TestReserveTimeout(t *testing.T) {
	s := startServer(t, ServerConfig{PoolBytes: 8 * testSlot, RegionBytes: 8 * testSlot, ReserveTimeout: 100 * time.Millisecond})
	c := dialMapped(t, s)
	keys := testKeys(3, 4)
	res, err := c.BeginStore(StoreRequest{Keys: keys}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var held []Slot
	for _, r := range res {
		held = append(held, r.Slot)
	}
	deadline := time.Now().Add(10 * time.Second)
	for s.Stats().ReservationsExpired < 4 {
		if time.Now().After(deadline) {
			t.Fatalf("not expired: %+v", s.Stats())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := c.CommitStore(held); err == nil {
		t.Fatal("a commit of expired reservations was taken")
	}
	st := s.Stats()
	if st.Cache.Writing != 0 || st.Cache.Free != 8 || st.Cache.StoreFailed != 4 {
		t.Fatalf("after expiry: %+v", st.Cache)
	}
	if n, _, _ := c.Lookup(keys, false, nil); n != 0 {
		t.Fatalf("%d expired blocks found", n)
	}
	// Reserved again and committed in time: stored.
	res, err = c.BeginStore(StoreRequest{Keys: keys}, nil)
	if err != nil {
		t.Fatal(err)
	}
	held = held[:0]
	for i, r := range res {
		if r.Outcome != StoreWrite {
			t.Fatalf("key %d: %d", i, r.Outcome)
		}
		held = append(held, r.Slot)
	}
	if err := c.CommitStore(held); err != nil {
		t.Fatal(err)
	}
}

// TestReleaseManyLeases (issue 52 item 4): a client's release costs in
// proportion to the slots it held, not the leases it took: 20.5M leases
// on 5,000 slots are released in under 100 ms, allocating next to
// nothing.
func TestReleaseManyLeases(t *testing.T) {
	const slots, perSlot = 5000, 4100
	s := startServer(t, ServerConfig{PoolBytes: slots * testSlot, ClientShare: 1, NoPrefault: true})
	c := dial(t, s.Addr(), ClientConfig{NoPrefault: true})
	defer c.Close()
	keys := testKeys(9, slots)
	res, err := c.BeginStore(StoreRequest{Keys: keys}, nil)
	if err != nil {
		t.Fatal(err)
	}
	handles := make([]kvcache.Slot, 0, slots)
	var committed []Slot
	for i, r := range res {
		if r.Outcome != StoreWrite {
			t.Fatalf("key %d: %d", i, r.Outcome)
		}
		committed = append(committed, r.Slot)
		handles = append(handles, kvcache.Slot{ID: kvcache.SlotID(r.Slot.ID), Gen: r.Slot.Gen})
	}
	if err := c.CommitStore(committed); err != nil {
		t.Fatal(err)
	}
	// A client's holdings as 20.5M leases would leave them: taken in the
	// index, counted in a peer's table.
	a, err := s.accts.open(s.lim, 1<<30, 0)
	if err != nil {
		t.Fatal(err)
	}
	p := &peer{s: s, id: 1 << 30, pidfd: -1, regions: map[uint32]bool{}, acct: a, done: make(chan struct{})}
	p.held.acct = a
	ok := make([]bool, 0, slots)
	for range perSlot {
		ok = s.cache.LeaseHandles(handles, ok[:0])
	}
	grant := a.grant(slots)
	for _, h := range handles {
		e, _ := p.held.take(uint32(h.ID), h.Gen)
		p.held.addLease(e, &grant)
		e.leases = perSlot
		p.held.leases += perSlot - 1
	}
	if st := s.cache.Stats(); st.Leased != slots || p.held.leases != slots*perSlot {
		t.Fatalf("%d leased, %d leases", st.Leased, p.held.leases)
	}
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	t0 := time.Now()
	s.release(p)
	took := time.Since(t0)
	runtime.ReadMemStats(&after)
	if st := s.cache.Stats(); st.Leased != 0 || st.Ready != slots {
		t.Fatalf("after release: %d leased, %d ready", st.Leased, st.Ready)
	}
	if took > 100*time.Millisecond {
		t.Fatalf("released %d leases in %v, want under 100 ms", slots*perSlot, took)
	}
	if grew := after.TotalAlloc - before.TotalAlloc; grew > 4<<20 {
		t.Fatalf("releasing %d leases allocated %d bytes", slots*perSlot, grew)
	}
	s.accts.closed(a)
	if n := a.slots.Load(); n != 0 {
		t.Fatalf("the account still counts %d slots", n)
	}
}

// TestLeaseCountBound (issue 52 item 4): a client's leases of one slot
// stop at maxSlotReads (its count cannot overflow): a Lookup past it
// leases a shorter prefix, and the count is unchanged.
func TestLeaseCountBound(t *testing.T) {
	s := startServer(t, ServerConfig{PoolBytes: 8 * testSlot, RegionBytes: 8 * testSlot})
	c := dialMapped(t, s)
	keys := testKeys(5, 1)
	res, err := c.BeginStore(StoreRequest{Keys: keys}, nil)
	if err != nil || res[0].Outcome != StoreWrite {
		t.Fatal(res, err)
	}
	if err := c.CommitStore([]Slot{res[0].Slot}); err != nil {
		t.Fatal(err)
	}
	_, leased, err := c.Lookup(keys, true, nil)
	if err != nil || len(leased) != 1 {
		t.Fatal(leased, err)
	}
	s.mu.Lock()
	var p *peer
	for _, q := range s.peers {
		p = q
	}
	s.mu.Unlock()
	// The node records a Lookup's leases (settle) after its reply went
	// out: wait for the record before changing it, and never stop the
	// test with p.mu held (the server's Close would wait for it).
	var e *holding
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		p.mu.Lock()
		if e = p.held.peek(leased[0].ID); e != nil && e.leases == 1 {
			e.leases = maxSlotReads // as if it had taken that many
			p.mu.Unlock()
			break
		}
		p.mu.Unlock()
		if time.Now().After(deadline) {
			t.Fatal("the first Lookup's lease was not recorded")
		}
	}
	hits, more, err := c.Lookup(keys, true, nil)
	if err != nil || hits != 0 || len(more) != 0 {
		t.Fatalf("a lease past %d on one slot: %d hits, %v", maxSlotReads, hits, err)
	}
	p.mu.Lock()
	got := e.leases
	e.leases = 1
	p.mu.Unlock()
	if got != maxSlotReads {
		t.Fatalf("lease count %d", got)
	}
	if err := c.Unlease(leased); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.OverShare == 0 || st.Cache.Leased != 0 {
		t.Fatalf("%+v", st)
	}
}

// TestConnCaps (issue 52 item 1): connections past MaxConns, or past
// MaxConnsPerClient of one process, are told why and closed; one that
// says no Hello within HelloTimeout is closed; the node serves on.
func TestConnCaps(t *testing.T) {
	s := startServer(t, ServerConfig{PoolBytes: 1 << 20, MaxConns: 4, MaxConnsPerClient: 3, HelloTimeout: 200 * time.Millisecond})
	var conns []*wire.Conn
	for range 3 {
		uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: s.Addr(), Net: "unixpacket"})
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, wire.NewConn(uc))
	}
	uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: s.Addr(), Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	var m wire.Msg
	if _, err := wire.NewConn(uc).Recv(&m); err != nil || m.Type != wire.TError ||
		!strings.Contains(m.Text, fmt.Sprintf("process %d has 3 connections to the node, at most 3", os.Getpid())) {
		t.Fatalf("a 4th connection of one process: %v %+v", err, m)
	}
	_ = uc.Close()
	// The silent ones are closed after HelloTimeout.
	for i, c := range conns {
		_ = c.UnixConn().SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Recv(&m); err == nil {
			t.Fatalf("connection %d: %+v before its close", i, m)
		} else if errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("connection %d: not closed after HelloTimeout", i)
		}
		_ = c.Close()
	}
	deadline := time.Now().Add(5 * time.Second)
	for st := s.Stats(); st.Connections != 0 || st.HelloTimeouts != 3; st = s.Stats() {
		if time.Now().After(deadline) {
			t.Fatalf("%+v", st)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if st := s.Stats(); st.ConnsRefused != 1 {
		t.Fatalf("%d refused", st.ConnsRefused)
	}
	dialMapped(t, s)
	// The total, and one user's connections together.
	l := limits{maxConns: 3, perClient: 2, perUser: 3}
	as := accounts{byPid: map[int32]*account{}, byUid: map[uint32]int{}}
	for _, pid := range []int32{1, 1, 2} {
		if _, err := as.open(l, pid, 7); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := as.open(l, 3, 8); err == nil || !strings.Contains(err.Error(), "the node has 3 connections, at most 3") {
		t.Fatalf("past MaxConns: %v", err)
	}
	l.maxConns = 10
	if _, err := as.open(l, 3, 7); err == nil || !strings.Contains(err.Error(), "uid 7 has 3 connections to the node, at most 3") {
		t.Fatalf("past MaxConnsPerUser: %v", err)
	}
	if _, err := as.open(l, 1, 8); err == nil || !strings.Contains(err.Error(), "process 1 has 2 connections to the node, at most 2") {
		t.Fatalf("past MaxConnsPerClient: %v", err)
	}
	if _, err := as.open(l, 4, 8); err != nil {
		t.Fatalf("another user: %v", err)
	}
}
