package clustertest

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Create makes one cluster of the running nodes on ports: the first masters
// are masters with even slot ranges, each later node a replica of master
// (i-masters)%masters. It asks each node with password (if not "") and
// gives redis-cli cli first (TLS).
//
// It does what redis-cli --cluster create does, except that it sends the
// CLUSTER MEETs again every second until every node knows every other one
// and none is still in handshake. redis-cli sends them once: a handshake
// that does not finish within cluster-node-timeout on a loaded machine is
// dropped, and redis-cli then waits for a join that never comes (the CI run
// of b1efff4 killed it after 30 s, in "Waiting for the cluster to join").
// Create gives up after d with the state of the node that was not joined.
func Create(ports []int, masters int, password string, cli []string, d time.Duration) error {
	if masters < 1 || masters > len(ports) {
		return fmt.Errorf("clustertest: %d masters for %d nodes", masters, len(ports))
	}
	run := runner(password, cli)
	if err := assign(run, ports, masters); err != nil {
		return err
	}
	if err := join(run, ports, d); err != nil {
		return err
	}
	for i, p := range ports[masters:] {
		id, err := run(ports[i%masters], "cluster", "myid")
		if err != nil {
			return err
		}
		if _, err := run(p, "cluster", "replicate", id); err != nil {
			return err
		}
	}
	return nil
}

// runner returns a function that runs redis-cli against a node with
// password and cli first, an ERR reply an error.
func runner(password string, cli []string) func(int, ...string) (string, error) {
	return func(p int, args ...string) (string, error) {
		out, err := CLI(p, password, append(append([]string(nil), cli...), args...)...)
		if err == nil && strings.HasPrefix(out, "ERR") {
			err = fmt.Errorf("%s", out)
		}
		if err != nil {
			return out, fmt.Errorf("node %d: %s: %v: %s", p, strings.Join(args, " "), err, out)
		}
		return out, nil
	}
}

// assign gives each node its own config epoch and each master its range
// of slots.
func assign(run func(int, ...string) (string, error), ports []int, masters int) error {
	const slots = 16384
	for i, p := range ports {
		if _, err := run(p, "cluster", "set-config-epoch", strconv.Itoa(i+1)); err != nil {
			return err
		}
		if i < masters {
			lo, hi := i*slots/masters, (i+1)*slots/masters-1
			if _, err := run(p, "cluster", "addslotsrange", strconv.Itoa(lo), strconv.Itoa(hi)); err != nil {
				return err
			}
		}
	}
	return nil
}

// join introduces every node to the first with CLUSTER MEET, again every
// second until all are joined (notJoined) or d has passed.
func join(run func(int, ...string) (string, error), ports []int, d time.Duration) error {
	deadline := time.Now().Add(d)
	for {
		// MEET on a node known or in handshake answers an error: ignored.
		for _, q := range ports[1:] {
			_, _ = run(ports[0], "cluster", "meet", "127.0.0.1", strconv.Itoa(q))
		}
		bad, err := "", error(nil)
		for wait := time.Now().Add(time.Second); time.Now().Before(wait); time.Sleep(50 * time.Millisecond) {
			if bad, err = notJoined(run, ports); err != nil || bad == "" {
				break
			}
		}
		if err != nil || bad == "" {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("clustertest: nodes not joined after %v: %s", d, bad)
		}
	}
}

// notJoined returns "" when every node on ports lists len(ports) nodes,
// none in handshake or without an address, else the first node's state
// that is not so.
func notJoined(run func(int, ...string) (string, error), ports []int) (string, error) {
	for _, p := range ports {
		out, err := run(p, "cluster", "nodes")
		if err != nil {
			return "", err
		}
		lines := strings.Split(strings.TrimSpace(out), "\n")
		if len(lines) != len(ports) || strings.Contains(out, "handshake") || strings.Contains(out, "noaddr") {
			return fmt.Sprintf("node %d knows %d of %d:\n%s", p, len(lines), len(ports), out), nil
		}
	}
	return "", nil
}
