package nodepool

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestHostileConnections (issue 52 item 1): one client makes 100,000
// connection attempts, holding hundreds open and saying nothing, at a node
// whose RLIMIT_NOFILE is 128: with its connection caps out of the way (so
// that its accepts fail with EMFILE), and with the default caps (which
// RLIMIT_NOFILE lowers: the flood is refused by them instead). Either way
// the node never stops serving, another client's stores and loads go on
// byte-exact throughout, and a new client connects once the flood ends.
func TestHostileConnections(t *testing.T) {
	t.Run("no caps", func(t *testing.T) { hostileFlood(t, "nocaps") })
	t.Run("default caps", func(t *testing.T) { hostileFlood(t, "default") })
}

func hostileFlood(t *testing.T, caps string) {
	sock := t.TempDir() + "/node.sock"
	node := startChild(t, "serve-lowfd", sock, "128 "+caps)
	node.expect(t, "listening")
	good := dial(t, sock, ClientConfig{})
	defer good.Close()
	if !good.WaitRegions(10 * time.Second) {
		t.Fatal("regions not mapped")
	}
	hostile := startChild(t, "hostile", sock, "100000 300")
	var rounds atomic.Int64
	stop := make(chan struct{})
	errc := make(chan error, 1)
	go func() {
		errc <- func() error {
			for round := 0; ; round++ {
				select {
				case <-stop:
					return nil
				default:
				}
				if err := storeLoad(good, round); err != nil {
					return fmt.Errorf("round %d: %w", round, err)
				}
				rounds.Add(1)
			}
		}()
	}()
	line := hostile.expect(t, "attempts")
	close(stop)
	if err := <-errc; err != nil {
		t.Fatalf("the well-behaved client, during the flood: %v", err)
	}
	t.Logf("hostile: %s; the other client served %d rounds meanwhile", line, rounds.Load())
	if rounds.Load() < 10 {
		t.Fatalf("the other client got %d rounds through during the flood", rounds.Load())
	}
	// A new client connects once the flood ends (the node may be in its
	// back-off, at most a second, or still accepting the connections the
	// flood left in its backlog).
	var c *Client
	for deadline := time.Now().Add(10 * time.Second); ; {
		var err error
		if c, err = Dial(sock, ClientConfig{Namespace: "test", Layout: testLayout, PrefaultThreads: 1}); err == nil {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("no new client once the flood ended: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := storeLoad(c, 1000); err != nil {
		t.Fatal(err)
	}
	st, err := c.Stats()
	if err != nil {
		t.Fatal(err)
	}
	_ = c.Close()
	t.Logf("node: %d accept errors, %d hello timeouts, %d accepted, %d refused (%d past a cap)",
		st.AcceptErrors, st.HelloTimeouts, st.Accepted, st.Refused, st.ConnsRefused)
	if caps == "nocaps" && st.AcceptErrors == 0 {
		t.Fatal("the node never ran out of descriptors: the test did not reach exhaustion")
	}
	if caps == "default" && st.ConnsRefused == 0 {
		t.Fatal("the caps refused nothing")
	}
	if err := storeLoad(good, 1001); err != nil {
		t.Fatal(err)
	}
}

// storeLoad stores 8 blocks of a round through c, loads them back and
// checks every byte.
func storeLoad(c *Client, round int) error {
	keys := testKeys(500+round, 8)
	res, err := c.BeginStore(StoreRequest{Keys: keys}, nil)
	if err != nil {
		return err
	}
	var slots []Slot
	for i, r := range res {
		if r.Outcome != StoreWrite {
			return fmt.Errorf("key %d: store outcome %d", i, r.Outcome)
		}
		fill(c.SlotBytes(r.Slot), keys[i])
		slots = append(slots, r.Slot)
	}
	if err := c.CommitStore(slots); err != nil {
		return err
	}
	lr, err := c.BeginLoad(keys, nil)
	if err != nil {
		return err
	}
	var ends []Slot
	var bad error
	for i, r := range lr {
		if !r.Found {
			bad = fmt.Errorf("key %d: not found after its store", i)
			continue
		}
		if err := check(c.SlotBytes(r.Slot), keys[i]); err != nil && bad == nil {
			bad = err
		}
		ends = append(ends, r.Slot)
	}
	if err := c.EndLoad(ends); err != nil {
		return err
	}
	return bad
}

// runLowFDNode is a node process (role "serve-lowfd", args "NOFILE caps")
// whose RLIMIT_NOFILE is NOFILE, with connection caps too high to matter
// (caps "nocaps") or the defaults, and a short HelloTimeout; it serves
// until killed, and exits 1 if Serve ever returns.
func runLowFDNode(socket, args string) int {
	f := strings.Fields(args)
	n, _ := strconv.ParseUint(f[0], 10, 64)
	var r unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &r); err != nil {
		fmt.Println("error", err)
		return 1
	}
	r.Cur = n
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &r); err != nil {
		fmt.Println("error", err)
		return 1
	}
	cfg := ServerConfig{Socket: socket, PoolBytes: 1 << 20, RegionBytes: 1 << 20, PrefaultThreads: 1, HelloTimeout: 300 * time.Millisecond}
	if f[1] == "nocaps" {
		cfg.MaxConns, cfg.MaxConnsPerClient = 1<<20, 1<<20
	}
	s, err := NewServer(cfg)
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	fmt.Println("listening", s.Addr())
	err = s.Serve()
	fmt.Println("error Serve returned:", err)
	return 1
}

// runHostile (role "hostile", args "attempts open") connects attempts
// times without a word, holding up to open connections (the oldest
// closed first), first holding open of them for a while so that the
// node's descriptors run out.
func runHostile(socket, args string) int {
	f := strings.Fields(args)
	attempts, _ := strconv.Atoi(f[0])
	open, _ := strconv.Atoi(f[1])
	ring := make([]int, 0, open)
	connected, refused := 0, 0
	addr := &unix.SockaddrUnix{Name: socket}
	for i := range attempts {
		if len(ring) == open {
			if i == open {
				time.Sleep(500 * time.Millisecond) // the node accepts until EMFILE
			}
			_ = unix.Close(ring[0])
			ring = append(ring[:0], ring[1:]...)
		}
		fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			fmt.Println("error socket:", err)
			return 1
		}
		switch err := unix.Connect(fd, addr); {
		case err == nil:
			connected++
			ring = append(ring, fd)
		case errors.Is(err, unix.EAGAIN), errors.Is(err, unix.ECONNREFUSED):
			refused++
			_ = unix.Close(fd)
		default:
			fmt.Println("error connect:", err)
			return 1
		}
	}
	for _, fd := range ring {
		_ = unix.Close(fd)
	}
	fmt.Printf("attempts %d: %d connected, %d refused by a full backlog\n", attempts, connected, refused)
	_, _ = io.Copy(io.Discard, os.Stdin)
	return 0
}

// TestIdleConnectionCost (issue 52 item 1): a connection that has not said
// Hello costs the node little memory (no full-size receive buffer, push
// queue or writer until its Hello).
func TestIdleConnectionCost(t *testing.T) {
	const n = 1000
	s := startServer(t, ServerConfig{PoolBytes: 1 << 20, MaxConns: 2 * n, MaxConnsPerClient: 2 * n})
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	var conns []*net.UnixConn
	defer func() {
		for _, c := range conns {
			_ = c.Close()
		}
	}()
	for range n {
		c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: s.Addr(), Net: "unixpacket"})
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	deadline := time.Now().Add(10 * time.Second)
	for s.Stats().Accepted < n {
		if time.Now().After(deadline) {
			t.Fatalf("%+v", s.Stats())
		}
		time.Sleep(10 * time.Millisecond)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	per := (int64(after.HeapInuse+after.StackInuse) - int64(before.HeapInuse+before.StackInuse)) / n
	t.Logf("%d bytes of the node's memory per idle connection", per)
	if per > 32<<10 {
		t.Fatalf("an idle connection costs the node %d bytes, want at most 32 KiB", per)
	}
}

// TestCloseWithSilentConnection: Close does not wait for a connection that
// has said nothing (its HelloTimeout is far off): it is closed with the
// others.
func TestCloseWithSilentConnection(t *testing.T) {
	s, err := NewServer(ServerConfig{Socket: t.TempDir() + "/node.sock", PoolBytes: 1 << 20, NoPrefault: true, HelloTimeout: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- s.Serve() }()
	uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: s.Addr(), Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer uc.Close()
	for deadline := time.Now().Add(5 * time.Second); s.Stats().Accepted == 0; {
		if time.Now().After(deadline) {
			t.Fatal("not accepted")
		}
		time.Sleep(5 * time.Millisecond)
	}
	closed := make(chan struct{})
	go func() {
		_ = s.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close waits for a connection that never said Hello")
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
