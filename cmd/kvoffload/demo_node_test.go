package main

import (
	"context"
	"encoding/json"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/offload"
)

// restartServe stops the `kvoffload serve` process node with sig and
// starts another on sock.
func restartServe(t *testing.T, node *exec.Cmd, sig syscall.Signal, sock string, args ...string) *exec.Cmd {
	t.Helper()
	require.NoError(t, node.Process.Signal(sig))
	_ = node.Wait()
	time.Sleep(100 * time.Millisecond)
	node, _ = startServeCmd(t, sock, args...)
	return node
}

// TestDemoConnectNodeRestart: the demo over a node (--connect) keeps
// serving while the node, a `kvoffload serve` process, restarts under it
// three times (SIGKILL, SIGTERM, SIGKILL), with copies slow enough (5 ms
// each) that the restarts land in stores and loads in flight. What the
// design names as the outcomes of a node gone (a store the node did not
// commit, a load whose node region is gone, a store refused busy, lookups
// finding nothing) are counted and recomputed, as the README tells a
// serving loop to do; the engine reconnects by itself; the run ends
// without error, reports the three restarts and the blocks they cost,
// and every block it loaded verifies.
func TestDemoConnectNodeRestart(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "node.sock")
	serveArgs := []string{"--pool", "4MiB", "--region", "1MiB"}
	node, _ := startServeCmd(t, sock, serveArgs...)
	cfg := tinyDemo(offload.BackendHost)
	cfg.connect, cfg.poolBytes, cfg.gpuBlocks, cfg.duration = sock, 2<<20, 32, 5*time.Second
	cfg.simDelay = 5 * time.Millisecond
	type result struct {
		rep *demoReport
		err error
	}
	done := make(chan result, 1)
	var notes syncBuffer
	go func() {
		rep, err := runDemo(context.Background(), cfg, nil, func(s string) { _, _ = notes.Write([]byte(s + "\n")) })
		done <- result{rep, err}
	}()
	for _, sig := range []syscall.Signal{syscall.SIGKILL, syscall.SIGTERM, syscall.SIGKILL} {
		time.Sleep(time.Second)
		node = restartServe(t, node, sig, sock, serveArgs...)
	}
	res := <-done
	require.NoError(t, res.err, "notices: %s", notes.String())
	rep := res.rep
	t.Logf("store %+v\nload %+v\nfirst node error %q\nnotices: %s", rep.Store, rep.Load, rep.FirstNodeError, notes.String())
	require.Equal(t, 3, rep.NodeReconnects, "the report counts the restarts")
	require.Positive(t, rep.Store.Unavailable+rep.Load.Unavailable, "the restarts met ops in flight")
	require.NotEmpty(t, rep.FirstNodeError)
	require.Contains(t, notes.String(), "the node is unavailable")
	require.Zero(t, rep.Store.Failed+rep.Load.Failed, "a node gone is not a failed copy")
	require.Empty(t, rep.FirstEngineError)
	require.Zero(t, rep.VerifyFailures)
	require.Equal(t, rep.Load.Blocks, rep.Verified)
	require.Positive(t, rep.Load.Blocks, "blocks stored since the last restart were loaded back")
	var out strings.Builder
	require.NoError(t, rep.print(&out))
	require.Contains(t, out.String(), "node restarts")
	require.Contains(t, out.String(), "3 (reconnected)")
	stopServe(t, node)
}

// TestDemoConnectNodeRestartCLI: `kvoffload demo --connect` as a process,
// its node restarted twice under it, exits 0 with a JSON report counting
// the restarts.
func TestDemoConnectNodeRestartCLI(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "node.sock")
	serveArgs := []string{"--pool", "4MiB", "--region", "1MiB"}
	node, _ := startServeCmd(t, sock, serveArgs...)
	demo, stdout, stderr := startCLI(t, "demo", "--json", "--connect", sock, "--backend", "host", "--layout", "tiny",
		"--pool-bytes", "2MiB", "--gpu-blocks", "32", "--duration", "3s", "--pinning", "none", "--seed", "5")
	for _, sig := range []syscall.Signal{syscall.SIGKILL, syscall.SIGTERM} {
		time.Sleep(time.Second)
		node = restartServe(t, node, sig, sock, serveArgs...)
	}
	require.NoError(t, demo.Wait(), "stderr %s\nstdout %s", stderr, stdout)
	var rep demoReport
	require.NoError(t, json.Unmarshal(stdout.Bytes(), &rep), "%s", stdout)
	require.Equal(t, 2, rep.NodeReconnects)
	require.Zero(t, rep.Store.Failed+rep.Load.Failed)
	require.Zero(t, rep.VerifyFailures)
	stopServe(t, node)
}
