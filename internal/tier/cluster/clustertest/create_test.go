package clustertest

import (
	"os/exec"
	"syscall"
	"testing"
	"time"
)

// TestCreateJoinsAStalledNode: a node stopped (SIGSTOP) for longer than
// cluster-node-timeout while the cluster is created, as a starved process
// on a loaded CI machine is, still joins: the first MEET's handshake is
// dropped by then and only a MEET sent again brings the node in (with
// MEETs sent once, as redis-cli --cluster create sends them, Create fails
// here with the node unknown to the others).
func TestCreateJoinsAStalledNode(t *testing.T) {
	Need(t)
	c := &Cluster{dir: t.TempDir(), procs: map[int]*exec.Cmd{}}
	avoid := map[int]bool{}
	for range 3 {
		p, err := FreePort(avoid)
		if err != nil {
			t.Fatal(err)
		}
		c.ports = append(c.ports, p)
	}
	t.Cleanup(c.Stop)
	if err := c.startNodes(); err != nil {
		t.Fatal(err)
	}
	run := runner("", nil)
	if err := assign(run, c.ports, 3); err != nil {
		t.Fatal(err)
	}
	stalled := c.procs[c.ports[2]].Process
	if err := stalled.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	resumed := make(chan error, 1)
	go func() {
		time.Sleep(2500 * time.Millisecond) // 2.5 x cluster-node-timeout
		resumed <- stalled.Signal(syscall.SIGCONT)
	}()
	err := join(run, c.ports, 20*time.Second)
	if rerr := <-resumed; rerr != nil {
		t.Fatal(rerr)
	}
	if err != nil {
		t.Fatal(err)
	}
	if err := c.waitOK(20 * time.Second); err != nil {
		t.Fatal(err)
	}
}
