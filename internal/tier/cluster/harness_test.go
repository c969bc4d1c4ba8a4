package cluster

import (
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/kvoffload/kvoffload/internal/tier/cluster/clustertest"
)

// testCluster is a Redis Cluster of real redis-server processes on loopback
// ports: masters first, then replicas.
type testCluster struct {
	dir      string
	password string
	ports    []int
	procs    map[int]*exec.Cmd
	masters  int
}

// needRedis skips when redis-server or redis-cli is not installed (.ci/run
// installs them with apt-get; only a machine where that failed lacks them).
func needRedis(tb testing.TB) {
	tb.Helper()
	for _, bin := range []string{"redis-server", "redis-cli"} {
		if _, err := exec.LookPath(bin); err != nil {
			tb.Skipf("%s not found: it could not be installed here (.ci/run installs it with apt-get install -y redis-server)", bin)
		}
	}
}

// startCluster starts masters masters with replicas replicas each (0 or 1)
// in dir, creates the cluster and waits for cluster_state:ok everywhere.
func startCluster(dir string, masters, replicas int, password string, extra ...string) (*testCluster, error) {
	ports, err := freePorts(masters * (1 + replicas))
	if err != nil {
		return nil, err
	}
	return startClusterOn(dir, ports, masters, replicas, password, extra...)
}

// freePorts returns n free port pairs (freePort).
func freePorts(n int) ([]int, error) {
	avoid := map[int]bool{}
	var ports []int
	for range n {
		p, err := clustertest.FreePort(avoid)
		if err != nil {
			return nil, err
		}
		ports = append(ports, p)
	}
	return ports, nil
}

// startClusterOn is startCluster on the given ports (masters first).
func startClusterOn(dir string, ports []int, masters, replicas int, password string, extra ...string) (*testCluster, error) {
	c := &testCluster{dir: dir, password: password, procs: map[int]*exec.Cmd{}, masters: masters}
	for _, p := range ports {
		args := []string{"--port", strconv.Itoa(p), "--bind", "127.0.0.1",
			"--cluster-enabled", "yes", "--cluster-config-file", fmt.Sprintf("nodes-%d.conf", p),
			"--cluster-node-timeout", "1000", "--save", "", "--appendonly", "no", "--dir", dir,
			// Each node its own RDB file: a replica's full sync renames the
			// snapshot it received to dbfilename in dir and loads that file,
			// so replicas sharing dir and the default dump.rdb could load
			// each other's snapshot (a promoted replica then lacks its
			// master's keys).
			"--dbfilename", fmt.Sprintf("dump-%d.rdb", p),
			"--enable-debug-command", "yes", "--logfile", fmt.Sprintf("redis-%d.log", p)}
		if password != "" {
			args = append(args, "--requirepass", password, "--masterauth", password)
		}
		args = append(args, extra...)
		cmd := exec.Command("redis-server", args...)
		if err := cmd.Start(); err != nil {
			c.stop()
			return nil, fmt.Errorf("start redis-server: %w", err)
		}
		c.ports = append(c.ports, p)
		c.procs[p] = cmd
	}
	for _, p := range c.ports {
		if err := clustertest.WaitDial(p, 5*time.Second); err != nil {
			c.stop()
			return nil, err
		}
	}
	if err := clustertest.Create(c.ports, masters, password, nil, 20*time.Second); err != nil {
		c.stop()
		return nil, err
	}
	if err := c.waitOK(20 * time.Second); err != nil {
		c.stop()
		return nil, err
	}
	return c, nil
}

// waitOK waits until every live node reports cluster_state:ok.
func (c *testCluster) waitOK(d time.Duration) error {
	return clustertest.WaitOK(c.ports, c.password, d, func(p int) bool { return c.procs[p] == nil })
}

// cli runs redis-cli against the node on port p.
func (c *testCluster) cli(p int, args ...string) (string, error) {
	return c.cliAt(p, args...)
}

func (c *testCluster) cliAt(p int, args ...string) (string, error) {
	return clustertest.CLI(p, c.password, args...)
}

func (c *testCluster) addrs() []string {
	var a []string
	for _, p := range c.ports[:c.masters] {
		a = append(a, "127.0.0.1:"+strconv.Itoa(p))
	}
	return a
}

// kill kills the node on port p.
func (c *testCluster) kill(p int) {
	if cmd := c.procs[p]; cmd != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		c.procs[p] = nil
	}
}

func (c *testCluster) stop() {
	for _, p := range c.ports {
		c.kill(p)
	}
}

// newCluster starts a cluster for one test, stopped at its end.
func newCluster(t *testing.T, masters, replicas int, password string, extra ...string) *testCluster {
	t.Helper()
	needRedis(t)
	c, err := startCluster(t.TempDir(), masters, replicas, password, extra...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.stop)
	return c
}

var (
	sharedOnce sync.Once
	sharedC    *testCluster
	sharedErr  error
	sharedDir  string
)

// shared returns the cluster of 3 masters the tests that do not kill nodes
// share (started once; TestMain stops it).
func shared(t testing.TB) *testCluster {
	t.Helper()
	needRedis(t)
	sharedOnce.Do(func() {
		sharedDir, sharedErr = os.MkdirTemp("", "kvo-cluster-")
		if sharedErr == nil {
			sharedC, sharedErr = startCluster(sharedDir, 3, 0, "")
		}
	})
	if sharedErr != nil {
		t.Fatal(sharedErr)
	}
	return sharedC
}

func TestMain(m *testing.M) {
	code := m.Run()
	if sharedC != nil {
		sharedC.stop()
	}
	if sharedDir != "" {
		os.RemoveAll(sharedDir)
	}
	os.Exit(code)
}
