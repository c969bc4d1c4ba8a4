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
// three times: SIGKILL right after a store was submitted (its copies take
// 5 ms: the node is gone before the commit), SIGTERM right before a load
// with a lease of the node's slots (the lease's region is gone when the
// load runs), SIGKILL after another store. What the design names as the
// outcomes of a node gone (a store the node did not commit, a load whose
// node region is gone, stores refused busy and lookups finding nothing
// while it is down) are counted and recomputed, as the README tells a
// serving loop to do; the engine reconnects by itself; the run ends
// without error, reports the three restarts and the blocks they cost,
// and every block it loaded verifies.
func TestDemoConnectNodeRestart(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "node.sock")
	serveArgs := []string{"--pool", "4MiB", "--region", "1MiB"}
	node, _ := startServeCmd(t, sock, serveArgs...)
	cfg := tinyDemo(offload.BackendHost)
	cfg.connect, cfg.poolBytes, cfg.gpuBlocks = sock, 2<<20, 32
	cfg.duration, cfg.requests = 0, 250
	cfg.simDelay = 5 * time.Millisecond
	// The restarts, in order: at the 20th store, the 5th load with a
	// lease counted from there, the 20th store after that. Each waits
	// 500 ms once the new node listens, for the engine to reconnect (it
	// redials every 200 ms) before the demo goes on.
	plan := []struct {
		step string
		n    int
		sig  syscall.Signal
	}{{"store", 20, syscall.SIGKILL}, {"load", 5, syscall.SIGTERM}, {"store", 20, syscall.SIGKILL}}
	seen := 0
	cfg.nodeStep = func(step string) {
		if len(plan) == 0 || step != plan[0].step {
			return
		}
		if seen++; seen < plan[0].n {
			return
		}
		node = restartServe(t, node, plan[0].sig, sock, serveArgs...)
		plan, seen = plan[1:], 0
		time.Sleep(500 * time.Millisecond)
	}
	var notes syncBuffer
	rep, err := runDemo(context.Background(), cfg, nil, func(s string) { _, _ = notes.Write([]byte(s + "\n")) })
	require.NoError(t, err, "notices: %s", notes.String())
	t.Logf("store %+v\nload %+v\nfirst node error %q\nnotices: %s", rep.Store, rep.Load, rep.FirstNodeError, notes.String())
	require.Empty(t, plan, "every restart ran")
	require.Equal(t, 250, rep.Requests)
	require.Equal(t, 3, rep.NodeReconnects, "the report counts the restarts")
	require.Positive(t, rep.Store.Unavailable, "stores the node did not commit")
	require.Positive(t, rep.Load.Unavailable, "loads of a node region gone")
	require.Contains(t, rep.FirstNodeError, "the node did not commit the store")
	require.Contains(t, notes.String(), "the node is unavailable")
	require.Zero(t, rep.Store.Failed+rep.Load.Failed, "a node gone is not a failed copy")
	require.Empty(t, rep.FirstEngineError)
	require.Zero(t, rep.VerifyFailures)
	require.Equal(t, rep.Load.Blocks, rep.Verified)
	require.Positive(t, rep.Load.Blocks, "blocks stored since the last restart were loaded back")
	requireConsistent(t, rep)
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
