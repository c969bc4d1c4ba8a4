package main

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvoffload/kvoffload/internal/nodepool"
	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/stretchr/testify/require"
)

// TestServe: serve listens on a 0600 socket and prints where, a client
// stores and finds a block through it, /metrics reports it, and SIGTERM
// stops it cleanly (status 143, socket removed).
func TestServe(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "node.sock")
	cmd := exec.Command(os.Args[0], "serve", "--socket", sock, "--pool", "8MiB", "--region", "4MiB", "--metrics", "127.0.0.1:0")
	cmd.Env = append(os.Environ(), "KVO_TEST_CLI=1")
	stdout, stderr := &syncBuffer{}, &syncBuffer{}
	cmd.Stdout, cmd.Stderr = stdout, stderr
	require.NoError(t, cmd.Start())
	defer func() { _ = cmd.Process.Kill() }()
	deadline := time.Now().Add(20 * time.Second)
	var metricsURL string
	for time.Now().Before(deadline) {
		out := stdout.String()
		if i := strings.Index(out, "http://"); i >= 0 && strings.Contains(out, "listening on "+sock) {
			metricsURL = strings.Fields(out[i:])[0]
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	require.NotEmpty(t, metricsURL, "stdout %q stderr %q", stdout, stderr)
	fi, err := os.Stat(sock)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())

	layout := nodepool.LayoutOf(kvcache.CrossLayer, kvcache.Geometry{Layers: 2, KVHeads: 2, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16})
	c, err := nodepool.Dial(sock, nodepool.ClientConfig{Namespace: "m", Layout: layout, Redial: -1, PrefaultThreads: 1})
	require.NoError(t, err)
	keys := []kvcache.Key{{1}, {2}}
	res, err := c.BeginStore(nodepool.StoreRequest{Keys: keys}, nil)
	require.NoError(t, err)
	copy(c.SlotBytes(res[0].Slot), "hello")
	require.NoError(t, c.CommitStore([]nodepool.Slot{res[0].Slot, res[1].Slot}))
	hits, leased, err := c.Lookup(keys, true, nil)
	require.NoError(t, err)
	require.Equal(t, 2, hits)
	require.Equal(t, "hello", string(c.SlotBytes(leased[0])[:5]))
	require.NoError(t, c.Unlease(leased))
	resp, err := http.Get(metricsURL)
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	require.Contains(t, string(body), "kvoffload_node_stored_total 2")
	require.Contains(t, string(body), "kvoffload_node_clients 1")
	require.Contains(t, string(body), "kvoffload_node_connections 1")
	require.Contains(t, string(body), "kvoffload_node_accept_errors_total 0")
	require.NotContains(t, string(body), "kvoffload_node_disk_", "no disk tier, no disk series")
	require.NoError(t, c.Close())

	stopServe(t, cmd, "stderr: %s", stderr)
	require.Contains(t, stdout.String(), "stopped")
	_, err = os.Stat(sock)
	require.True(t, os.IsNotExist(err), "socket left behind: %v", err)
}

// syncBuffer is a bytes.Buffer a test may read while a child writes it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// startServeCmd runs `kvoffload serve --socket sock args...` and waits
// until it listens.
func startServeCmd(t *testing.T, sock string, args ...string) (*exec.Cmd, *syncBuffer) {
	t.Helper()
	cmd := exec.Command(os.Args[0], append([]string{"serve", "--socket", sock}, args...)...)
	cmd.Env = append(os.Environ(), "KVO_TEST_CLI=1")
	stdout, stderr := &syncBuffer{}, &syncBuffer{}
	cmd.Stdout, cmd.Stderr = stdout, stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	require.Eventually(t, func() bool { return strings.Contains(stdout.String(), "listening on "+sock) }, 20*time.Second, 10*time.Millisecond,
		"stdout %q stderr %q", stdout, stderr)
	return cmd, stdout
}

// serveMetrics waits for serve's metrics address on stdout and returns
// what /metrics serves.
func serveMetrics(t *testing.T, stdout *syncBuffer) string {
	t.Helper()
	var url string
	require.Eventually(t, func() bool {
		out := stdout.String()
		i := strings.Index(out, "http://")
		if i >= 0 {
			url = strings.Fields(out[i:])[0]
		}
		return i >= 0
	}, 20*time.Second, 10*time.Millisecond, "stdout %q", stdout)
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(body)
}

// TestServeDisk: `serve --disk --disk-write-through` writes the blocks
// stored to disk, and a node restarted on the same directory has them
// from its first lookup,
// after its pool's (empty) hits, and loads them byte-exact; /metrics
// carries the tier (up, records, lookup hits, promotions). --disk-bytes
// without --disk is a usage error.
func TestServeDisk(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(t.TempDir(), "node.sock")
	layout := nodepool.LayoutOf(kvcache.CrossLayer, kvcache.Geometry{Layers: 2, KVHeads: 2, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16})
	keys := []kvcache.Key{{1}, {2}}
	for round := range 2 {
		cmd, stdout := startServeCmd(t, sock, "--pool", "4MiB", "--disk", dir, "--disk-bytes", "4MiB", "--disk-write-through", "--metrics", "127.0.0.1:0")
		require.Contains(t, serveMetrics(t, stdout), "kvoffload_node_disk_up 0", "not open before the first client's layout")
		require.Contains(t, stdout.String(), "disk tier of 4 MiB in "+dir)
		require.Contains(t, stdout.String(), "evicted blocks seen twice written back, every block stored written through")
		c, err := nodepool.Dial(sock, nodepool.ClientConfig{Namespace: "m", Layout: layout, Redial: -1, PrefaultThreads: 1})
		require.NoError(t, err)
		if round == 0 {
			storeHelloWorld(t, c, keys)
		} else {
			hits, lower, _, err := c.LookupTiers(keys, false, nil)
			require.NoError(t, err)
			require.Equal(t, 0, hits, "a restarted node's pool is empty")
			require.Equal(t, 2, lower, "its disk has both blocks")
			loadHelloWorld(t, c, keys)
			m := serveMetrics(t, stdout)
			for _, want := range []string{"kvoffload_node_disk_up 1", "kvoffload_node_disk_records 2",
				"kvoffload_node_disk_lookup_hits_total 2", "kvoffload_node_disk_promoted_total 2", "kvoffload_node_disk_corrupt_total 0"} {
				require.Contains(t, m, want)
			}
		}
		require.NoError(t, c.Close())
		stopServe(t, cmd)
		require.Contains(t, stdout.String(), "stopped")
	}
	bad := exec.Command(os.Args[0], "serve", "--socket", sock, "--disk-bytes", "1MiB")
	bad.Env = append(os.Environ(), "KVO_TEST_CLI=1")
	out, err := bad.CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(out), "--disk-bytes needs --disk")
}

// TestServeDiskAdmission: serve's admission flags reach the node. A pool
// of 256 slots takes 320 blocks, each stored once: by default none is
// admitted (the not-admitted series counts them, nothing is written);
// with --disk-admit-all (and a write-back bound of one block) the
// evictions are written back or dropped, none refused. The disk flags
// need --disk, and --disk-admit-after takes 1 to 15.
func TestServeDiskAdmission(t *testing.T) {
	layout := nodepool.LayoutOf(kvcache.CrossLayer, kvcache.Geometry{Layers: 2, KVHeads: 2, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16})
	for _, tc := range []struct {
		args []string
		want string
		ok   func(m map[string]float64) bool
	}{
		{nil, "evicted blocks seen twice written back", func(m map[string]float64) bool {
			return m["disk_not_admitted_total"] > 0 && m["disk_writes_total"] == 0 && m["disk_dropped_total"] == 0
		}},
		{[]string{"--disk-admit-all", "--disk-write-back-bytes", "16KiB"}, "every evicted block written back", func(m map[string]float64) bool {
			return m["disk_not_admitted_total"] == 0 && m["disk_writes_total"] > 0 && m["disk_writes_total"]+m["disk_dropped_total"] == m["evicted_total"]
		}},
	} {
		sock := filepath.Join(t.TempDir(), "node.sock")
		cmd, stdout := startServeCmd(t, sock, append([]string{"--pool", "4MiB", "--disk", t.TempDir(), "--metrics", "127.0.0.1:0"}, tc.args...)...)
		serveMetrics(t, stdout)
		require.Contains(t, stdout.String(), tc.want)
		c, err := nodepool.Dial(sock, nodepool.ClientConfig{Namespace: "m", Layout: layout, Redial: -1, PrefaultThreads: 1})
		require.NoError(t, err)
		for b := range 10 {
			keys := make([]kvcache.Key, 32)
			for i := range keys {
				keys[i] = kvcache.Key{7: byte(b), 6: byte(i), 5: 0x5a, 0: 1}
			}
			res, err := c.BeginStore(nodepool.StoreRequest{Keys: keys}, nil)
			require.NoError(t, err)
			var slots []nodepool.Slot
			for _, r := range res {
				require.Equal(t, nodepool.StoreWrite, r.Outcome)
				slots = append(slots, r.Slot)
			}
			require.NoError(t, c.CommitStore(slots))
		}
		require.Eventually(t, func() bool {
			m := map[string]float64{}
			for _, line := range strings.Split(serveMetrics(t, stdout), "\n") {
				if f := strings.Fields(line); len(f) == 2 && strings.HasPrefix(f[0], "kvoffload_node_") {
					var v float64
					_, _ = fmt.Sscan(f[1], &v)
					m[strings.TrimPrefix(f[0], "kvoffload_node_")] = v
				}
			}
			return m["evicted_total"] > 0 && tc.ok(m)
		}, 10*time.Second, 20*time.Millisecond, "%v: %s", tc.args, serveMetrics(t, stdout))
		require.NoError(t, c.Close())
		stopServe(t, cmd)
	}
	for _, args := range [][]string{{"--disk-admit-all"}, {"--disk-write-through"}, {"--disk-admit-after", "3"}, {"--disk-write-back-bytes", "1MiB"}} {
		bad := exec.Command(os.Args[0], append([]string{"serve", "--socket", filepath.Join(t.TempDir(), "s")}, args...)...)
		bad.Env = append(os.Environ(), "KVO_TEST_CLI=1")
		out, err := bad.CombinedOutput()
		require.Error(t, err)
		require.Contains(t, string(out), args[0]+" needs --disk")
	}
	bad := exec.Command(os.Args[0], "serve", "--socket", filepath.Join(t.TempDir(), "s"), "--disk", t.TempDir(), "--disk-admit-after", "16")
	bad.Env = append(os.Environ(), "KVO_TEST_CLI=1")
	out, err := bad.CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(out), "--disk-admit-after 16: want 1 to 15")
}

// TestServeDiskWriteBackOnClose: with --disk-write-back-on-close, SIGTERM
// writes the pool's blocks (none evicted, none written back before) to
// disk and says so, and a node restarted on the directory loads them
// byte-exact; without it, or with a --disk-close-timeout already passed
// at shutdown (the blocks counted as not written), a restart finds none.
// The flag needs --disk, --disk-close-timeout needs it.
func TestServeDiskWriteBackOnClose(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(t.TempDir(), "node.sock")
	layout := nodepool.LayoutOf(kvcache.CrossLayer, kvcache.Geometry{Layers: 2, KVHeads: 2, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16})
	keys := []kvcache.Key{{1}, {2}}
	for _, tc := range []struct {
		args      []string
		onDisk    int    // blocks a lookup finds on disk at start
		atClose   string // what SIGTERM prints ("": nothing about a write at close)
		noMetrics bool
	}{
		{[]string{"--disk-write-back-on-close", "--disk-close-timeout", "1ns"}, 0, "wrote 0 blocks of the pool to disk at close, 2 not written (--disk-close-timeout 1ns passed)\n", true},
		{nil, 0, "", true},
		{[]string{"--disk-write-back-on-close"}, 0, "wrote 2 blocks of the pool to disk at close\n", false},
		{nil, 2, "", true},
	} {
		args := append([]string{"--pool", "4MiB", "--disk", dir, "--disk-bytes", "4MiB", "--metrics", "127.0.0.1:0"}, tc.args...)
		cmd, stdout := startServeCmd(t, sock, args...)
		m := serveMetrics(t, stdout)
		if !tc.noMetrics {
			require.Contains(t, stdout.String(), "the pool's blocks written at shutdown")
			require.Contains(t, m, "kvoffload_node_disk_written_at_close_total 0")
			require.Contains(t, m, "kvoffload_node_disk_left_at_close_total 0")
		}
		c, err := nodepool.Dial(sock, nodepool.ClientConfig{Namespace: "m", Layout: layout, Redial: -1, PrefaultThreads: 1})
		require.NoError(t, err)
		hits, lower, _, err := c.LookupTiers(keys, false, nil)
		require.NoError(t, err)
		require.Equal(t, 0, hits, "%v: a restarted node's pool is empty", tc.args)
		require.Equal(t, tc.onDisk, lower, "%v: blocks on disk at start", tc.args)
		if tc.onDisk == 0 {
			storeHelloWorld(t, c, keys)
		} else {
			loadHelloWorld(t, c, keys)
		}
		require.NoError(t, c.Close())
		stopServe(t, cmd)
		out := stdout.String()
		require.Contains(t, out, "stopped")
		if tc.atClose != "" {
			require.Contains(t, out, "kvoffload serve: "+tc.atClose)
		} else {
			require.NotContains(t, out, "at close")
		}
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--disk-write-back-on-close"}, "--disk-write-back-on-close needs --disk"},
		{[]string{"--disk", t.TempDir(), "--disk-close-timeout", "5s"}, "--disk-close-timeout needs --disk-write-back-on-close"},
		{[]string{"--disk", t.TempDir(), "--disk-write-back-on-close", "--disk-close-timeout", "0s"}, "--disk-close-timeout 0s must be positive"},
	} {
		bad := exec.Command(os.Args[0], append([]string{"serve", "--socket", filepath.Join(t.TempDir(), "s")}, tc.args...)...)
		bad.Env = append(os.Environ(), "KVO_TEST_CLI=1")
		out, err := bad.CombinedOutput()
		require.Error(t, err)
		require.Contains(t, string(out), tc.want)
	}
}

// storeHelloWorld stores "hello" and "world" under the two keys through
// the node client c.
func storeHelloWorld(t *testing.T, c *nodepool.Client, keys []kvcache.Key) {
	t.Helper()
	res, err := c.BeginStore(nodepool.StoreRequest{Keys: keys}, nil)
	require.NoError(t, err)
	copy(c.SlotBytes(res[0].Slot), "hello")
	copy(c.SlotBytes(res[1].Slot), "world")
	require.NoError(t, c.CommitStore([]nodepool.Slot{res[0].Slot, res[1].Slot}))
}

// loadHelloWorld loads the two keys through c and requires storeHelloWorld's
// bytes.
func loadHelloWorld(t *testing.T, c *nodepool.Client, keys []kvcache.Key) {
	t.Helper()
	res, err := c.BeginLoad(keys, nil)
	require.NoError(t, err)
	require.True(t, res[0].Found && res[1].Found)
	require.Equal(t, "hello", string(c.SlotBytes(res[0].Slot)[:5]))
	require.Equal(t, "world", string(c.SlotBytes(res[1].Slot)[:5]))
	require.NoError(t, c.EndLoad([]nodepool.Slot{res[0].Slot, res[1].Slot}))
}

// stopServe sends serve SIGTERM and waits (10 s at most) for it to exit
// with 143; msg (a format and its arguments) is added to a failure.
func stopServe(t *testing.T, cmd *exec.Cmd, msg ...any) {
	t.Helper()
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case <-exited:
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		<-exited
		require.Fail(t, "serve still running 10 s after SIGTERM", msg...)
	}
	require.Equal(t, 143, cmd.ProcessState.ExitCode(), msg...)
}

// TestServeUsageErrors (issue 52 item 10): serve's bad values are usage
// errors (exit 2) naming the flag, the value and the limit, refused
// before any memory is mapped; a pool the machine cannot hold is refused
// (exit 1) naming the limit, before it is mapped.
func TestServeUsageErrors(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "node.sock")
	long := filepath.Join(dir, strings.Repeat("s", nodepool.MaxSocketPath-len(dir)))
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"--pool", "0"}, "--pool 0: the pool must be a positive size"},
		{[]string{"--region", "65GiB"}, "--region 65GiB: at most 64GiB"},
		{[]string{"--socket", long}, fmt.Sprintf("is %d bytes, at most 107", len(long))},
		{[]string{"--client-share", "0"}, "--client-share 0: want a fraction"},
		{[]string{"--client-share", "1.5"}, "--client-share 1.5"},
		{[]string{"--max-conns", "-1"}, "--max-conns -1 must not be negative"},
		{[]string{"--hello-timeout", "0s"}, "--hello-timeout 0s must be positive"},
		{[]string{"--reserve-timeout", "-1s"}, "--reserve-timeout -1s must be positive"},
		{[]string{"--numa-node", "-2"}, "--numa-node -2"},
	} {
		args := append([]string{"serve", "--socket", sock}, tt.args...)
		code, _, errs := runCLI(t, args...)
		require.Equal(t, exitUsage, code, "%v: %s", tt.args, errs)
		require.Contains(t, errs, tt.want, "%v", tt.args)
		_, err := os.Lstat(sock)
		require.True(t, os.IsNotExist(err), "%v: the socket was bound", tt.args)
	}
	code, _, errs := runCLI(t, "serve", "--socket", sock, "--pool", "256TiB", "--hugetlb=false")
	require.Equal(t, exitError, code, errs)
	require.Contains(t, errs, "insufficient memory for the pool")
	require.Contains(t, errs, "281474976710656 bytes")
}
