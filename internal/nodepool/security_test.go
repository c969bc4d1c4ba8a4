package nodepool

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvoffload/kvoffload/internal/nodepool/wire"
)

// TestGroupSocket: with a group, the socket is 0660 and owned by it.
func TestGroupSocket(t *testing.T) {
	s := startServer(t, ServerConfig{PoolBytes: 1 << 20, Group: strconv.Itoa(os.Getgid())})
	fi, err := os.Stat(s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o660 || int(fi.Sys().(*syscall.Stat_t).Gid) != os.Getgid() {
		t.Fatalf("socket %v gid %d", fi.Mode(), fi.Sys().(*syscall.Stat_t).Gid)
	}
	c := dial(t, s.Addr(), ClientConfig{})
	_ = c.Close()
}

// TestPeerOfAnotherUID: a peer of another uid (not root, not in the
// group) is refused by SO_PEERCRED even when it can reach the socket.
// Needs root to start the peer as another user.
func TestPeerOfAnotherUID(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to run a peer as another uid")
	}
	s := startServer(t, ServerConfig{PoolBytes: 1 << 20})
	// Let anyone reach the socket: the credential check must stop them.
	if err := os.Chmod(s.Addr(), 0o777); err != nil {
		t.Fatal(err)
	}
	dir := s.Addr()[:len(s.Addr())-len("/node.sock")]
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	// The test binary where uid 65534 can run it.
	bin := filepath.Join(dir, "nodepool.test")
	b, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, b, 0o755); err != nil {
		t.Fatal(err)
	}
	for d := dir; strings.HasPrefix(d, os.TempDir()) && d != os.TempDir(); d = filepath.Dir(d) {
		_ = os.Chmod(d, 0o777)
	}
	cmd := exec.Command(bin, "-test.run=^$")
	cmd.Env = append(os.Environ(), "NODEPOOL_CHILD=writer", "NODEPOOL_SOCKET="+s.Addr(), "NODEPOOL_ARGS=1 1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatalf("a peer of uid 65534 was served: %s", out)
	}
	var exit *exec.ExitError
	if !errors.As(err, &exit) {
		t.Skipf("cannot run the peer as uid 65534 here: %v", err)
	}
	if st := s.Stats(); st.Refused != 1 || st.Accepted != 0 {
		t.Fatalf("stats %+v; child said %s", st, out)
	}
	t.Logf("refused: %s", out)
}

// TestEvents: a client subscribed to KV events sees another client's
// blocks become ready and leave.
func TestEvents(t *testing.T) {
	s := startServer(t, ServerConfig{PoolBytes: 1 << 20})
	var mu sync.Mutex
	var got []wire.Event
	sub := dial(t, s.Addr(), ClientConfig{OnEvents: func(evs []wire.Event) {
		mu.Lock()
		got = append(got, evs...)
		mu.Unlock()
	}})
	defer sub.Close()
	// The subscription is asynchronous to Dial: wait for it.
	deadline := time.Now().Add(10 * time.Second)
	for s.subscribers.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	w := dial(t, s.Addr(), ClientConfig{})
	defer w.Close()
	keys := testKeys(8, 3)
	res, err := w.BeginStore(StoreRequest{Keys: keys}, nil)
	if err != nil {
		t.Fatal(err)
	}
	slots := []Slot{res[0].Slot, res[1].Slot, res[2].Slot}
	if err := w.CommitStore(slots); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Delete(keys[:1]); err != nil {
		t.Fatal(err)
	}
	for {
		mu.Lock()
		n := len(got)
		mu.Unlock()
		if n >= 4 || time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Millisecond)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(got) != 4 || got[3].Kind != wire.EventRemoved || got[3].Key != keys[0] || got[0].Kind != wire.EventStored ||
		got[0].NS != w.Info().NamespaceID {
		t.Fatalf("events %+v", got)
	}
}

// TestTimeoutGivesBack: a request whose reply comes after its timeout is
// ErrUnavailable to the caller, and what the late reply leased is given
// back by the client.
func TestTimeoutGivesBack(t *testing.T) {
	s := startServer(t, ServerConfig{PoolBytes: 1 << 20})
	c := dial(t, s.Addr(), ClientConfig{})
	defer c.Close()
	keys := testKeys(9, 4)
	res, _ := c.BeginStore(StoreRequest{Keys: keys}, nil)
	_ = c.CommitStore([]Slot{res[0].Slot, res[1].Slot, res[2].Slot, res[3].Slot})
	c.timeout.Store(1)
	_, _, err := c.Lookup(keys, true, nil)
	c.timeout.Store(int64(10 * time.Second))
	if err == nil {
		t.Skip("the reply beat a 1 ns timer")
	}
	if !errors.Is(err, ErrUnavailable) {
		t.Fatal(err)
	}
	waitStats(t, s, "late lease given back", func(st Stats) bool { return st.Cache.Leased == 0 && st.Cache.LookupHits == 4 })
}

// TestNoMap: a client without a GPU (scheduler, router) maps nothing but
// looks up, leases and reads the node's stats; its leases hold blocks
// like anyone's and are released with it.
func TestNoMap(t *testing.T) {
	s := startServer(t, ServerConfig{PoolBytes: 1 << 20})
	w := dial(t, s.Addr(), ClientConfig{})
	defer w.Close()
	keys := testKeys(12, 4)
	res, _ := w.BeginStore(StoreRequest{Keys: keys}, nil)
	if err := w.CommitStore([]Slot{res[0].Slot, res[1].Slot, res[2].Slot, res[3].Slot}); err != nil {
		t.Fatal(err)
	}
	r := dial(t, s.Addr(), ClientConfig{NoMap: true})
	if len(r.Regions()) != 0 {
		t.Fatal("a NoMap client mapped regions")
	}
	hits, leased, err := r.Lookup(keys, true, nil)
	if err != nil || hits != 4 || leased[0].Addr != 0 {
		t.Fatalf("%d hits %v %v", hits, leased, err)
	}
	if st, err := r.Stats(); err != nil || st.Cache.Leased != 4 {
		t.Fatalf("stats %+v %v", st.Cache, err)
	}
	if _, err := r.BeginLoad(keys, nil); !errors.Is(err, ErrInvalid) {
		t.Fatalf("load without mappings: %v", err)
	}
	if _, err := r.Trim(1 << 20); err != nil {
		t.Fatal(err)
	}
	// The leased region drains only once the scheduler lets go.
	if st := s.Stats(); st.FreedBytes != 0 || st.RegionsRetiring != 1 {
		t.Fatalf("stats %+v", st)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	waitStats(t, s, "freed", func(st Stats) bool { return st.FreedBytes == 1<<20 })
}
