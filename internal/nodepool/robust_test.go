package nodepool

import (
	"errors"
	"net"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/kvoffload/kvoffload/internal/nodepool/wire"
	"golang.org/x/sys/unix"
)

// TestNodeGoesAway: with the node gone, ops fail with ErrUnavailable, the
// regions are retired locally (the hook sees the leased bytes intact
// first), and the client reconnects to the next node, whose pool is empty:
// misses, never wrong blocks.
func TestNodeGoesAway(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "node.sock")
	s1, err := NewServer(ServerConfig{Socket: sock, PoolBytes: 1 << 20, PrefaultThreads: 1})
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = s1.Serve() }()
	keys := testKeys(5, 10)
	var mu sync.Mutex
	var leased []Slot
	var seen []error
	var c *Client
	c = dial(t, sock, ClientConfig{Redial: 10 * time.Millisecond, Hooks: Hooks{RegionRetiring: func(r *Region) {
		// The engine waits for its copies here; the bytes are intact.
		mu.Lock()
		defer mu.Unlock()
		for i, sl := range leased {
			if sl.Region == r.ID {
				seen = append(seen, check(c.SlotBytes(sl), keys[i]))
			}
		}
	}}})
	defer c.Close()
	res, err := c.BeginStore(StoreRequest{Keys: keys}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var slots []Slot
	for i, r := range res {
		fill(c.SlotBytes(r.Slot), keys[i])
		slots = append(slots, r.Slot)
	}
	if err := c.CommitStore(slots); err != nil {
		t.Fatal(err)
	}
	// A store in flight when the node goes.
	pending, err := c.BeginStore(StoreRequest{Keys: testKeys(6, 3)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	_, leased, err = c.Lookup(keys, true, nil)
	mu.Unlock()
	if err != nil || len(leased) != 10 {
		t.Fatalf("lookup: %d, %v", len(leased), err)
	}
	if err := s1.Close(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for c.Available() && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if _, _, err := c.Lookup(keys, false, nil); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("lookup with the node gone: %v", err)
	}
	for {
		mu.Lock()
		n := len(seen)
		mu.Unlock()
		if n == 10 || time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Millisecond)
	}
	mu.Lock()
	if len(seen) != 10 {
		t.Fatalf("the retiring hook saw %d leased blocks", len(seen))
	}
	for _, e := range seen {
		if e != nil {
			t.Fatal(e)
		}
	}
	mu.Unlock()
	s2, err := NewServer(ServerConfig{Socket: sock, PoolBytes: 1 << 20, PrefaultThreads: 1})
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = s2.Serve() }()
	defer s2.Close()
	for !c.Available() && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if c.Info().Epoch != 2 {
		t.Fatalf("epoch %d after reconnecting", c.Info().Epoch)
	}
	// Handles of the old node: commits fail, releases are no-ops.
	var old []Slot
	for _, r := range pending {
		old = append(old, r.Slot)
	}
	if err := c.CommitStore(old); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("commit across a restart: %v", err)
	}
	if err := c.Unlease(leased); err != nil {
		t.Fatalf("unlease across a restart: %v", err)
	}
	if h, _, err := c.Lookup(keys, false, nil); err != nil || h != 0 {
		t.Fatalf("after the restart: %d hits, %v", h, err)
	}
	res, err = c.BeginStore(StoreRequest{Keys: keys}, res[:0])
	if err != nil || res[0].Outcome != StoreWrite {
		t.Fatalf("store after the restart: %v %v", res, err)
	}
}

// TestHostileMessages: garbage, truncated, oversized and out-of-place
// messages and passed descriptors get errors; the node keeps serving that
// client and the others.
func TestHostileMessages(t *testing.T) {
	s := startServer(t, ServerConfig{PoolBytes: 1 << 20})
	good := dial(t, s.Addr(), ClientConfig{})
	defer good.Close()
	uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: s.Addr(), Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	conn := wire.NewConn(uc)
	defer conn.Close()
	var m wire.Msg
	recvErr := func(want uint16) {
		t.Helper()
		for {
			if _, err := conn.Recv(&m); err != nil {
				t.Fatal(err)
			}
			if m.ReqID != 0 || m.Type == wire.TError { // skip pushes
				break
			}
		}
		if m.Type != wire.TError || m.Code != want {
			t.Fatalf("got %v code %d (%s), want error code %d", m.Type, m.Code, m.Text, want)
		}
	}
	raw := func(b []byte, oob []byte) {
		t.Helper()
		if _, _, err := uc.WriteMsgUnix(b, oob, nil); err != nil {
			t.Fatal(err)
		}
	}
	raw([]byte{0xff, 1, 2}, nil)
	recvErr(wire.CodeMalformed)
	raw([]byte{byte(wire.TLookup), 0, 0, 0, 7, 0, 0, 0, 0xff, 0xff, 0xff, 0xff}, nil)
	recvErr(wire.CodeMalformed)
	// A descriptor from a client is refused (and closed).
	var pp [2]int
	if err := unix.Pipe(pp[:]); err != nil {
		t.Fatal(err)
	}
	p, q := pp[0], pp[1]
	defer unix.Close(p)
	hello, _ := wire.Encode(nil, &wire.Msg{Type: wire.THello, ReqID: 1, Version: wire.Version, Namespace: "test", Layout: testLayout})
	raw(hello, unix.UnixRights(q))
	_ = unix.Close(q)
	recvErr(wire.CodeMalformed)
	// A request before Hello ends the connection after its error.
	raw(mustEncode(t, &wire.Msg{Type: wire.TStats, ReqID: 2}), nil)
	recvErr(wire.CodeHandshake)
	// The good client is still served.
	if _, err := good.Stats(); err != nil {
		t.Fatal(err)
	}
	// After Hello: a head range, a duplicate key, a foreign handle, Hello
	// twice, and a push type sent as a request.
	uc2, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: s.Addr(), Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	conn = wire.NewConn(uc2)
	uc = uc2
	raw(hello, nil)
	if _, err := conn.Recv(&m); err != nil || m.Type != wire.THelloOK {
		t.Fatalf("hello: %v %v", m.Type, err)
	}
	k := testKeys(9, 2)
	// Heads beyond the namespace's (2): a clear error, nothing reserved.
	raw(mustEncode(t, &wire.Msg{Type: wire.TBeginStore, ReqID: 3, Flags: wire.FlagChain, HeadLo: 1, HeadHi: 5, Keys: k}), nil)
	recvErr(wire.CodeInvalid)
	raw(mustEncode(t, &wire.Msg{Type: wire.TBeginStore, ReqID: 4, Flags: wire.FlagChain, Keys: []Key{k[0], k[0]}}), nil)
	recvErr(wire.CodeInvalid)
	raw(mustEncode(t, &wire.Msg{Type: wire.TCommitStore, ReqID: 5, Handles: []wire.Handle{{ID: 0, Gen: 0}}}), nil)
	recvErr(wire.CodeNotYours)
	raw(mustEncode(t, &wire.Msg{Type: wire.TEndLoad, ReqID: 6, Handles: []wire.Handle{{ID: 1 << 31, Gen: 9}}}), nil)
	recvErr(wire.CodeNotYours)
	raw(hello, nil)
	recvErr(wire.CodeHandshake)
	raw(mustEncode(t, &wire.Msg{Type: wire.TRegionRetire, ReqID: 7}), nil)
	recvErr(wire.CodeMalformed)
	raw(mustEncode(t, &wire.Msg{Type: wire.TRetireAck, ReqID: 8, Region: wire.Region{ID: 77}}), nil)
	recvErr(wire.CodeNotYours)
	if _, err := good.Stats(); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.Malformed != 3 {
		t.Fatalf("malformed count %d", st.Malformed)
	}
}

func mustEncode(t *testing.T, m *wire.Msg) []byte {
	b, err := wire.Encode(nil, m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// FuzzServer: whatever a client sends after its Hello, the node answers
// and keeps serving.
func FuzzServer(f *testing.F) {
	f.Add([]byte{byte(wire.TLookup), 1, 0, 0, 9, 0, 0, 0, 1, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16})
	f.Add([]byte{byte(wire.TCommitStore), 0, 0, 0, 9, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})
	// Version 3's requests: a BeginLoad that leaves the disk for later and
	// a Promote (to a node without a disk tier).
	for _, m := range []wire.Msg{
		{Type: wire.TBeginLoad, ReqID: 9, Flags: wire.FlagDiskLater, Keys: []wire.Key{{1}, {2}}},
		{Type: wire.TPromote, ReqID: 9, Parents: []wire.Key{{}, {1}}, Keys: []wire.Key{{1}, {2}}},
	} {
		b, err := wire.Encode(nil, &m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	s := startServer(f, ServerConfig{PoolBytes: 1 << 20})
	f.Fuzz(func(t *testing.T, b []byte) {
		uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: s.Addr(), Net: "unixpacket"})
		if err != nil {
			t.Fatal(err)
		}
		conn := wire.NewConn(uc)
		defer conn.Close()
		var m wire.Msg
		hello := &wire.Msg{Type: wire.THello, ReqID: 1, Version: wire.Version, Namespace: "test", Layout: testLayout}
		if err := conn.Send(hello, -1); err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Recv(&m); err != nil || m.Type != wire.THelloOK {
			t.Fatalf("hello: %v %v", m.Type, err)
		}
		defer conn.Close()
		if len(b) == 0 {
			return
		}
		if _, _, err := uc.WriteMsgUnix(b, nil, nil); err != nil {
			t.Fatal(err)
		}
		_ = uc.SetReadDeadline(time.Now().Add(5 * time.Second))
		for {
			fd, err := conn.Recv(&m)
			if fd >= 0 {
				_ = unix.Close(fd)
			}
			if err != nil {
				if wire.IsClosed(err) && m.Type == wire.TBye {
					return
				}
				if errors.Is(err, wire.ErrMalformed) {
					continue
				}
				t.Fatalf("no answer: %v", err)
			}
			if m.ReqID != 0 || m.Type == wire.TError || m.Type == wire.TOK {
				break
			}
		}
		// The node still serves: a fresh Stats on this connection, unless
		// the input was a goodbye.
		if m.Type == wire.TOK && len(b) >= 1 && wire.Type(b[0]) == wire.TBye {
			return
		}
		if err := conn.Send(&wire.Msg{Type: wire.TStats, ReqID: 99}, -1); err != nil {
			t.Fatal(err)
		}
		for {
			fd, err := conn.Recv(&m)
			if fd >= 0 {
				_ = unix.Close(fd)
			}
			if err != nil {
				t.Fatalf("stats after %x: %v", b, err)
			}
			if m.ReqID == 99 {
				break
			}
		}
	})
}

// TestDialHungNode: a socket whose node never answers is ErrUnavailable
// after the timeout, not a hang.
func TestDialHungNode(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "hung.sock")
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: sock, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	done := make(chan struct{})
	defer close(done)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			defer c.Close()
			<-done
		}
	}()
	start := time.Now()
	_, err = Dial(sock, ClientConfig{Namespace: "x", Layout: testLayout, Timeout: 200 * time.Millisecond})
	if !errors.Is(err, ErrUnavailable) || time.Since(start) > 3*time.Second {
		t.Fatalf("after %v: %v", time.Since(start), err)
	}
}
