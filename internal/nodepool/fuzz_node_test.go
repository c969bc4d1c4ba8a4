package nodepool

import (
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/nodepool/wire"
)

// rawClient is a client that speaks the wire protocol directly, as a
// careless or hostile one would: it maps nothing and may give back any
// handle.
type rawClient struct {
	conn  *wire.Conn
	req   uint32
	held  []wire.Handle // handles it was given (leases, loads, reservations), mixed
	in    wire.Msg
	alive bool
}

func dialRaw(socket string) (*rawClient, error) {
	uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: socket, Net: "unixpacket"})
	if err != nil {
		return nil, err
	}
	r := &rawClient{conn: wire.NewConn(uc), alive: true}
	_ = uc.SetReadDeadline(time.Now().Add(30 * time.Second))
	m, err := r.call(&wire.Msg{Type: wire.THello, Version: wire.Version, Namespace: "test", Layout: testLayout})
	if err != nil || m.Type != wire.THelloOK {
		_ = r.conn.Close()
		return nil, fmt.Errorf("hello: %v %v", m.Type, err)
	}
	return r, nil
}

// call sends m with the next request id and returns its reply (pushes
// skipped, their descriptors closed).
func (r *rawClient) call(m *wire.Msg) (*wire.Msg, error) {
	r.req++
	m.ReqID = r.req
	if err := r.conn.Send(m, -1); err != nil {
		return nil, err
	}
	return r.reply(r.req)
}

func (r *rawClient) reply(req uint32) (*wire.Msg, error) {
	for {
		fd, err := r.conn.Recv(&r.in)
		if fd >= 0 {
			_ = unix.Close(fd)
		}
		if err != nil {
			return nil, err
		}
		if r.in.ReqID == req {
			return &r.in, nil
		}
	}
}

// fuzzOp is one hostile op of FuzzNodeClients: kind and argument bytes.
func (r *rawClient) op(t *testing.T, kind byte, arg []byte, keysOf func(byte) []Key) {
	a := func(i int) byte {
		if i < len(arg) {
			return arg[i]
		}
		return 0
	}
	pick := func() []wire.Handle {
		var hs []wire.Handle
		for i, h := range r.held {
			if a(1)>>uint(i%8)&1 == 1 {
				hs = append(hs, h)
			}
		}
		if a(2)&1 == 1 { // a foreign or made-up handle
			hs = append(hs, wire.Handle{ID: uint32(a(3)) % 80, Gen: uint32(a(4)) % 4})
		}
		return hs
	}
	var m *wire.Msg
	switch kind % 10 {
	case 0:
		m = &wire.Msg{Type: wire.TLookup, Flags: wire.FlagLease, Keys: keysOf(a(0))}
	case 1:
		m = &wire.Msg{Type: wire.TUnlease, Handles: pick()}
	case 2:
		// Stores only in its own keys: a commit writes no bytes, so a
		// key of the well-behaved client's would be another's block.
		m = &wire.Msg{Type: wire.TBeginStore, Flags: wire.FlagChain, Keys: testKeys(7, int(a(0)%16)+1)}
	case 3:
		m = &wire.Msg{Type: wire.TCommitStore, Handles: pick()}
	case 4:
		m = &wire.Msg{Type: wire.TAbortStore, Handles: pick()}
	case 5:
		m = &wire.Msg{Type: wire.TBeginLoad, Keys: keysOf(a(0))}
	case 6:
		m = &wire.Msg{Type: wire.TEndLoad, Handles: pick()}
	case 7:
		m = &wire.Msg{Type: wire.TDelete, Keys: keysOf(a(0))}
	case 8:
		// Garbage: the argument bytes as a message (not an empty one: a
		// packet socket reads 0 bytes only at the peer's close, so the
		// node takes it for one).
		if len(arg) == 0 {
			return
		}
		if _, _, err := r.conn.UnixConn().WriteMsgUnix(arg, nil, nil); err != nil {
			t.Errorf("garbage %x: %v", arg, err)
			r.alive = false
			return
		}
		// A goodbye ends the connection. Otherwise its reply (an error,
		// or the answer to whatever it decoded as, under whatever request
		// id it carried) is skipped: a Stats of a fresh id is sent and
		// everything before its answer read.
		var d wire.Msg
		if wire.Decode(arg, &d) == nil && d.Type == wire.TBye {
			r.alive = false
			return
		}
		r.req += 1 << 16
		if err := r.conn.Send(&wire.Msg{Type: wire.TStats, ReqID: r.req}, -1); err != nil {
			t.Errorf("after garbage %x: %v", arg, err)
			r.alive = false
			return
		}
		for {
			m, err := r.reply(r.req)
			if err != nil {
				t.Errorf("after garbage %x: no answer: %v", arg, err)
				r.alive = false
				return
			}
			if m.Type == wire.TStatsOK {
				return
			}
		}
	case 9:
		m = &wire.Msg{Type: wire.TStats}
	}
	if len(m.Handles) == 0 && (m.Type == wire.TUnlease || m.Type == wire.TCommitStore || m.Type == wire.TAbortStore || m.Type == wire.TEndLoad) {
		return
	}
	if m.Type == wire.TBeginLoad || m.Type == wire.TLookup {
		// BeginLoad refuses duplicates as a whole; keep the keys distinct.
		m.Keys = distinct(m.Keys)
	}
	rep, err := r.call(m)
	if err != nil {
		t.Errorf("op %v: no reply: %v", m.Type, err)
		r.alive = false
		return
	}
	for _, s := range rep.Slots {
		r.held = append(r.held, s.Handle())
	}
	if len(r.held) > 64 {
		r.held = r.held[len(r.held)-64:]
	}
}

func distinct(keys []Key) []Key {
	seen := map[Key]bool{}
	out := keys[:0]
	for _, k := range keys {
		if !seen[k] {
			seen[k] = true
			out = append(out, k)
		}
	}
	return out
}

// goodKeys are the well-behaved client's keys of a round: 16 seeds of 4
// keys, reused, so that a block stored in an earlier iteration is found
// and checked again.
func goodKeys(round int) []Key { return testKeys(2000+round%16, 4) }

// FuzzNodeClients drives the node with random message sequences from three
// clients at once (leases, loads, reservations, commits and aborts of their
// own and made-up handles, deletes, garbage), each connection's ops from
// its share of the input, while a well-behaved client stores and loads:
// every block it loads is byte-exact, every store it was given it can
// commit, and the node serves on (a Stats of every client answers at the
// end).
func FuzzNodeClients(f *testing.F) {
	f.Add([]byte{0, 1, 3, 5, 2, 4, 8, 1, 0, 0, 1, 1, 2})
	f.Add([]byte{6, 9, 9, 9, 15, 0, 1, 7, 255, 255, 3, 1, 2, 3, 21, 4, 1, 1})
	f.Add([]byte{0, 3, 3, 1, 1, 1, 5, 0, 255, 1, 5, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17})
	s := startServer(f, ServerConfig{PoolBytes: 1 << 20, ClientShare: 1})
	good := dialMapped(f, s)
	var rounds atomic.Int64
	keysOf := func(b byte) []Key {
		n := int(b%8) + 1
		if b&0x80 != 0 {
			return testKeys(7, n)
		}
		return goodKeys(int(b>>3) % 16)[:min(n, 4)]
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		const clients = 3
		ops := make([][][]byte, clients)
		for i := 0; i+1 < len(b); {
			n := int(b[i+1] % 6)
			end := min(i+2+n, len(b))
			c := int(b[i]) % clients
			ops[c] = append(ops[c], b[i:end])
			i = end
		}
		raws := make([]*rawClient, clients)
		for i := range raws {
			r, err := dialRaw(s.Addr())
			if err != nil {
				t.Fatal(err)
			}
			raws[i] = r
		}
		var wg sync.WaitGroup
		for i, r := range raws {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for _, op := range ops[i] {
					if !r.alive {
						return
					}
					r.op(t, op[0]/clients, op[2:], keysOf)
				}
			}()
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 3 {
				if err := goodRound(good, int(rounds.Add(1))); err != nil {
					t.Error(err)
					return
				}
			}
		}()
		wg.Wait()
		for i, r := range raws {
			if r.alive {
				if m, err := r.call(&wire.Msg{Type: wire.TStats}); err != nil || m.Type != wire.TStatsOK {
					t.Errorf("client %d: the node did not answer Stats: %v", i, err)
				}
				_, _ = r.call(&wire.Msg{Type: wire.TBye})
			}
			_ = r.conn.Close()
		}
		if st := s.Stats(); st.InternalErrors != 0 {
			t.Fatalf("%d internal errors", st.InternalErrors)
		}
	})
}

// goodRound stores a round's blocks (those written, filled and committed)
// and loads every block of the round that is found, checking its bytes.
func goodRound(c *Client, round int) error {
	keys := goodKeys(round)
	res, err := c.BeginStore(StoreRequest{Keys: keys}, nil)
	if err != nil {
		return err
	}
	var slots []Slot
	for i, r := range res {
		if r.Outcome == StoreWrite {
			fill(c.SlotBytes(r.Slot), keys[i])
			slots = append(slots, r.Slot)
		}
	}
	if len(slots) > 0 {
		if err := c.CommitStore(slots); err != nil {
			return fmt.Errorf("round %d: commit: %w", round, err)
		}
	}
	lr, err := c.BeginLoad(keys, nil)
	if err != nil {
		return err
	}
	var ends []Slot
	var bad error
	for i, r := range lr {
		if !r.Found {
			continue // deleted or evicted meanwhile
		}
		if err := check(c.SlotBytes(r.Slot), keys[i]); err != nil && bad == nil {
			bad = fmt.Errorf("round %d: %w", round, err)
		}
		ends = append(ends, r.Slot)
	}
	if err := c.EndLoad(ends); err != nil {
		return err
	}
	return bad
}
