package main

import (
	"bytes"
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

	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/kvoffload/kvoffload/nodepool"
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
	require.NoError(t, c.Close())

	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case <-exited:
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		<-exited
		t.Fatalf("still running after SIGTERM; stderr %s", stderr)
	}
	require.Equal(t, 143, cmd.ProcessState.ExitCode(), "stderr: %s", stderr)
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
