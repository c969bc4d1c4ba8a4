// Package clustertest starts a Redis Cluster of real redis-server processes
// on loopback ports for other packages' tests (offload, cmd/kvoffload).
// Tests skip where redis-server or redis-cli is not installed.
package clustertest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// Cluster is a running Redis Cluster of masters without replicas.
type Cluster struct {
	dir   string
	mu    sync.Mutex
	ports []int
	procs map[int]*exec.Cmd
	// tls: the nodes serve TLS only (StartTLS), redis-cli is given tlsCLI.
	tls    *TLSFiles
	tlsCLI []string
}

// Need skips tb when redis-server or redis-cli is not installed.
func Need(tb testing.TB) {
	tb.Helper()
	for _, bin := range []string{"redis-server", "redis-cli"} {
		if _, err := exec.LookPath(bin); err != nil {
			tb.Skipf("%s not found: it could not be installed here (.ci/run installs it with apt-get install -y redis-server)", bin)
		}
	}
}

// Start starts a cluster of masters nodes for tb (skipping tb without
// redis-server), stopped when tb ends.
func Start(tb testing.TB, masters int) *Cluster {
	tb.Helper()
	Need(tb)
	c, err := start(tb.TempDir(), masters)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(c.Stop)
	return c
}

// Addrs returns the nodes' addresses, host:port.
func (c *Cluster) Addrs() []string {
	var a []string
	for _, p := range c.ports {
		a = append(a, "127.0.0.1:"+strconv.Itoa(p))
	}
	return a
}

// Ports returns the nodes' loopback ports, in Addrs' order.
func (c *Cluster) Ports() []int { return append([]int(nil), c.ports...) }

// Stop kills every node (a cluster gone mid-run); a second Stop does nothing.
func (c *Cluster) Stop() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, p := range c.ports {
		if cmd := c.procs[p]; cmd != nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			c.procs[p] = nil
		}
	}
}

// Reserve picks the loopback ports of a cluster of masters nodes for tb
// without starting it (Addrs answers at once; nothing listens until
// Launch), so that a client can be pointed at a cluster that is not up yet.
// It skips tb without redis-server; the cluster, once launched, is stopped
// when tb ends.
func Reserve(tb testing.TB, masters int) *Cluster {
	tb.Helper()
	Need(tb)
	c := &Cluster{dir: tb.TempDir(), procs: map[int]*exec.Cmd{}}
	avoid := map[int]bool{}
	for range masters {
		p, err := FreePort(avoid)
		if err != nil {
			tb.Fatal(err)
		}
		c.ports = append(c.ports, p)
	}
	tb.Cleanup(c.Stop)
	return c
}

// Launch starts the nodes of a reserved cluster on its ports and creates the
// cluster (waiting until every node reports cluster_state:ok).
func (c *Cluster) Launch() error {
	return c.launch()
}

func start(dir string, masters int) (*Cluster, error) {
	return startWith(dir, masters, nil)
}

func startWith(dir string, masters int, tf *TLSFiles) (*Cluster, error) {
	c := &Cluster{dir: dir, procs: map[int]*exec.Cmd{}, tls: tf}
	if tf != nil {
		c.tlsCLI = []string{"--tls", "--cacert", tf.CA}
	}
	avoid := map[int]bool{}
	for range masters {
		p, err := FreePort(avoid)
		if err != nil {
			return nil, err
		}
		c.ports = append(c.ports, p)
	}
	if err := c.launch(); err != nil {
		return nil, err
	}
	return c, nil
}

func (c *Cluster) launch() error {
	if err := c.startNodes(); err != nil {
		return err
	}
	if err := Create(c.ports, len(c.ports), "", c.tlsCLI, 20*time.Second); err != nil {
		c.Stop()
		return err
	}
	if err := c.waitOK(20 * time.Second); err != nil {
		c.Stop()
		return err
	}
	return nil
}

// startNodes starts a redis-server on each of c's ports and waits until
// each accepts connections; the nodes know nothing of each other yet.
func (c *Cluster) startNodes() error {
	for _, p := range c.ports {
		port := []string{"--port", strconv.Itoa(p)}
		if tf := c.tls; tf != nil {
			port = []string{"--port", "0", "--tls-port", strconv.Itoa(p), "--tls-cluster", "yes", "--tls-replication", "yes",
				"--tls-cert-file", tf.Cert, "--tls-key-file", tf.Key, "--tls-ca-cert-file", tf.CA, "--tls-auth-clients", "no"}
		}
		cmd := exec.Command("redis-server", append(port, "--bind", "127.0.0.1",
			"--cluster-enabled", "yes", "--cluster-config-file", fmt.Sprintf("nodes-%d.conf", p),
			"--cluster-node-timeout", "1000", "--save", "", "--appendonly", "no", "--dir", c.dir,
			"--dbfilename", fmt.Sprintf("dump-%d.rdb", p), // one RDB file a node (see internal/tier/cluster's harness)
			"--logfile", fmt.Sprintf("redis-%d.log", p))...)
		if err := cmd.Start(); err != nil {
			c.Stop()
			return fmt.Errorf("start redis-server: %w", err)
		}
		c.mu.Lock()
		c.procs[p] = cmd
		c.mu.Unlock()
	}
	for _, p := range c.ports {
		if err := WaitDial(p, 5*time.Second); err != nil {
			c.Stop()
			return err
		}
	}
	return nil
}

// FreePort returns a loopback port free for a node and its cluster bus
// (port+10000), not in avoid, and adds it to avoid.
func FreePort(avoid map[int]bool) (int, error) {
	for range 200 {
		p := 20000 + rand.IntN(25000)
		if avoid[p] || avoid[p+10000] || avoid[p-10000] {
			continue
		}
		ok := true
		for _, q := range []int{p, p + 10000} {
			l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(q))
			if err != nil {
				ok = false
				break
			}
			l.Close()
		}
		if ok {
			avoid[p] = true
			return p, nil
		}
	}
	return 0, fmt.Errorf("no free port pair")
}

// WaitDial waits up to d until loopback port p accepts connections.
func WaitDial(p int, d time.Duration) error {
	deadline := time.Now().Add(d)
	for {
		conn, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(p), 100*time.Millisecond)
		if err == nil {
			conn.Close()
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("redis-server on port %d did not come up: %w", p, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (c *Cluster) waitOK(d time.Duration) error { return waitOK(c.ports, "", c.tlsCLI, d, nil) }

// WaitOK waits up to d until every node on ports (those skip does not
// leave out) reports cluster_state:ok, asking with password if not "".
func WaitOK(ports []int, password string, d time.Duration, skip func(port int) bool) error {
	return waitOK(ports, password, nil, d, skip)
}

// waitOK is WaitOK with redis-cli given cli first (TLS).
func waitOK(ports []int, password string, cli []string, d time.Duration, skip func(port int) bool) error {
	deadline := time.Now().Add(d)
	for {
		bad := ""
		for _, p := range ports {
			if skip != nil && skip(p) {
				continue
			}
			out, err := CLI(p, password, append(append([]string(nil), cli...), "cluster", "info")...)
			if err != nil || !strings.Contains(out, "cluster_state:ok") {
				bad = fmt.Sprintf("node %d: %v %s", p, err, out)
				break
			}
		}
		if bad == "" {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("cluster not ok after %v: %s", d, bad)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// CLI runs redis-cli against loopback port p, with password if not "",
// and returns its trimmed output.
func CLI(p int, password string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	base := []string{"-h", "127.0.0.1", "-p", strconv.Itoa(p)}
	if password != "" {
		base = append(base, "-a", password, "--no-auth-warning")
	}
	out, err := exec.CommandContext(ctx, "redis-cli", append(base, args...)...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}
