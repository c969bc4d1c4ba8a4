package nodepool

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvoffload/kvoffload/kvcache"
)

// testLayout: cross-layer blocks of 16 KiB.
var testLayout = LayoutOf(kvcache.CrossLayer, kvcache.Geometry{Layers: 2, KVHeads: 2, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16})

const testSlot = 16 << 10

// startServer runs a node on a socket in a fresh directory.
func startServer(t testing.TB, cfg ServerConfig) *Server {
	t.Helper()
	if cfg.Socket == "" {
		cfg.Socket = filepath.Join(t.TempDir(), "node.sock")
	}
	if cfg.PrefaultThreads == 0 {
		cfg.PrefaultThreads = 1
	}
	s, err := NewServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- s.Serve() }()
	t.Cleanup(func() {
		_ = s.Close()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return s
}

func dial(t testing.TB, socket string, cfg ClientConfig) *Client {
	t.Helper()
	if cfg.Namespace == "" {
		cfg.Namespace = "test"
	}
	if cfg.Layout == (Layout{}) {
		cfg.Layout = testLayout
	}
	if cfg.PrefaultThreads == 0 {
		cfg.PrefaultThreads = 1
	}
	c, err := Dial(socket, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// dialMapped dials s with the test layout, closes the client when t
// ends, and waits until the client has mapped the pool's regions.
func dialMapped(t testing.TB, s *Server) *Client {
	t.Helper()
	c := dial(t, s.Addr(), ClientConfig{})
	t.Cleanup(func() { c.Close() })
	if !c.WaitRegions(10 * time.Second) {
		t.Fatal("regions not mapped")
	}
	return c
}

// testKeys returns n distinct keys of a seed.
func testKeys(seed, n int) []Key {
	keys := make([]Key, n)
	for i := range keys {
		keys[i] = Key{byte(seed), byte(seed >> 8), 0xee, byte(i), byte(i >> 8), byte(i >> 16)}
	}
	return keys
}

// fill writes the bytes a block of key k holds in the tests.
func fill(b []byte, k Key) {
	for i := range b {
		b[i] = k[i%16] ^ byte(i/16) ^ byte(i>>12)
	}
}

// check reports the first byte of b that is not what fill wrote for k.
func check(b []byte, k Key) error {
	for i := range b {
		if want := k[i%16] ^ byte(i/16) ^ byte(i>>12); b[i] != want {
			return fmt.Errorf("key %v byte %d: %d, want %d", k, i, b[i], want)
		}
	}
	return nil
}

// ---- child processes ---------------------------------------------------------

// TestMain runs a child role when the test binary is re-executed by
// startChild (the environment names the role), the tests otherwise.
func TestMain(m *testing.M) {
	if role := os.Getenv("NODEPOOL_CHILD"); role != "" {
		os.Exit(runChild(role, os.Getenv("NODEPOOL_SOCKET"), os.Getenv("NODEPOOL_ARGS")))
	}
	os.Exit(m.Run())
}

type child struct {
	cmd   *exec.Cmd
	lines chan string
}

// startChild re-executes the test binary as a client process.
func startChild(t *testing.T, role, socket, args string) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	// GORACE: a race-built child otherwise sleeps a second at exit.
	cmd.Env = append(os.Environ(), "NODEPOOL_CHILD="+role, "NODEPOOL_SOCKET="+socket, "NODEPOOL_ARGS="+args,
		"GORACE="+strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ch := &child{cmd: cmd, lines: make(chan string, 64)}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			ch.lines <- sc.Text()
		}
		close(ch.lines)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return ch
}

// expect waits for the child's next line and checks its prefix.
func (c *child) expect(t *testing.T, prefix string) string {
	t.Helper()
	select {
	case l, ok := <-c.lines:
		if !ok {
			t.Fatalf("child ended before %q", prefix)
		}
		if !strings.HasPrefix(l, prefix) {
			t.Fatalf("child said %q, want %q...", l, prefix)
		}
		return l
	case <-time.After(30 * time.Second):
		t.Fatalf("child silent, want %q", prefix)
	}
	return ""
}

func (c *child) wait(t *testing.T) {
	t.Helper()
	for range c.lines {
	}
	if err := c.cmd.Wait(); err != nil {
		t.Fatalf("child: %v", err)
	}
}

// runChild is a client process: role "writer" stores and commits blocks
// of a seed; "reader" leases and checks them; "hang" reserves blocks,
// writes half of each, and waits to be killed; "drop" reserves, closes
// its connection without goodbye, and waits to be killed.
func runChild(role, socket, args string) int {
	switch role {
	case "serve":
		return runNode(socket, args)
	case "serve-lowfd":
		return runLowFDNode(socket, args)
	case "hostile":
		return runHostile(socket, args)
	}
	f := strings.Fields(args)
	seed, _ := strconv.Atoi(f[0])
	n, _ := strconv.Atoi(f[1])
	c, err := Dial(socket, ClientConfig{Namespace: "test", Layout: testLayout, PrefaultThreads: 1})
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	keys := testKeys(seed, n)
	say := func(format string, a ...any) { fmt.Printf(format+"\n", a...) }
	switch role {
	case "writer":
		res, err := c.BeginStore(StoreRequest{Keys: keys}, nil)
		if err != nil {
			say("error %v", err)
			return 1
		}
		var slots []Slot
		for i, r := range res {
			if r.Outcome != StoreWrite {
				say("error key %d: outcome %d", i, r.Outcome)
				return 1
			}
			fill(c.SlotBytes(r.Slot), keys[i])
			slots = append(slots, r.Slot)
		}
		if err := c.CommitStore(slots); err != nil {
			say("error %v", err)
			return 1
		}
		say("stored %d", len(slots))
	case "reader":
		hits, leased, err := c.Lookup(keys, true, nil)
		if err != nil {
			say("error %v", err)
			return 1
		}
		for i, s := range leased {
			if err := check(c.SlotBytes(s), keys[i]); err != nil {
				say("error %v", err)
				return 1
			}
		}
		if err := c.Unlease(leased); err != nil {
			say("error %v", err)
			return 1
		}
		say("verified %d", hits)
	case "churn":
		// Store seed after seed, each block written in two halves with a
		// pause between, until killed.
		for sd := seed; ; sd++ {
			ks := testKeys(sd, n)
			res, err := c.BeginStore(StoreRequest{Keys: ks}, nil)
			if err != nil {
				say("error %v", err)
				return 1
			}
			var slots []Slot
			for i, r := range res {
				if r.Outcome == StoreWrite {
					b := c.SlotBytes(r.Slot)
					tmp := make([]byte, len(b))
					fill(tmp, ks[i])
					copy(b[:len(b)/2], tmp)
					slots = append(slots, r.Slot)
				}
			}
			time.Sleep(time.Duration(sd%3) * time.Millisecond)
			for i, r := range res {
				if r.Outcome == StoreWrite {
					b := c.SlotBytes(r.Slot)
					tmp := make([]byte, len(b))
					fill(tmp, ks[i])
					copy(b[len(b)/2:], tmp[len(b)/2:])
				}
			}
			if err := c.CommitStore(slots); err != nil {
				say("error %v", err)
				return 1
			}
			if sd == seed {
				say("churning")
			}
		}
	case "hog":
		// Store n blocks, lease half of those written, reserve n more
		// without committing, and hold it all until killed.
		res, err := c.BeginStore(StoreRequest{Keys: keys}, nil)
		if err != nil {
			say("error %v", err)
			return 1
		}
		var slots []Slot
		var written []Key
		for i, r := range res {
			if r.Outcome == StoreWrite {
				fill(c.SlotBytes(r.Slot), keys[i])
				slots = append(slots, r.Slot)
				written = append(written, keys[i])
			}
		}
		if err := c.CommitStore(slots); err != nil {
			say("error %v", err)
			return 1
		}
		_, leased, err := c.Lookup(written[:len(written)/2], true, nil)
		if err != nil {
			say("error %v", err)
			return 1
		}
		res, err = c.BeginStore(StoreRequest{Keys: testKeys(seed+1, n)}, nil)
		if err != nil {
			say("error %v", err)
			return 1
		}
		reserved := 0
		for _, r := range res {
			if r.Outcome == StoreWrite {
				reserved++
			}
		}
		say("hogging %d %d %d", len(slots), len(leased), reserved)
		_, _ = io.Copy(io.Discard, os.Stdin) // until killed
		select {}
	case "hang", "drop":
		res, err := c.BeginStore(StoreRequest{Keys: keys}, nil)
		if err != nil {
			say("error %v", err)
			return 1
		}
		for i, r := range res {
			if r.Outcome == StoreWrite {
				// Half a block, as a copy cut short.
				fill(c.SlotBytes(r.Slot)[:testSlot/2], keys[i])
			}
		}
		// A lease too, on whatever the seed-1 writer stored.
		if _, _, err := c.Lookup(testKeys(1, n), true, nil); err != nil {
			say("error %v", err)
			return 1
		}
		if role == "drop" {
			c.mu.Lock()
			conn := c.conn
			c.cfg.Redial = -1
			c.mu.Unlock()
			_ = conn.Close()
		}
		say("reserved %d", len(res))
		_, _ = io.Copy(io.Discard, os.Stdin) // until killed
		select {}
	}
	if err := c.Close(); err != nil {
		say("error %v", err)
		return 1
	}
	return 0
}

// runNode is a node process (role "serve"): args is the pool size in
// bytes; it serves until stdin closes.
func runNode(socket, args string) int {
	pool, _ := strconv.ParseInt(strings.TrimSpace(args), 10, 64)
	s, err := NewServer(ServerConfig{Socket: socket, PoolBytes: pool, RegionBytes: pool, PrefaultThreads: 1})
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		_ = s.Close()
	}()
	fmt.Println("listening", s.Addr())
	if err := s.Serve(); err != nil {
		fmt.Println("error", err)
		return 1
	}
	return 0
}
