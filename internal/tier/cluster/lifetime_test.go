package cluster

import (
	"context"
	"os/exec"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/tier/cluster/clustertest"
)

// goroutines returns the stacks of the running goroutines by id.
func goroutines() map[int]string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	gs := map[int]string{}
	for _, g := range strings.Split(string(buf), "\n\n") {
		head, _, _ := strings.Cut(strings.TrimPrefix(g, "goroutine "), " ")
		if id, err := strconv.Atoi(head); err == nil {
			gs[id] = g
		}
	}
	return gs
}

// noNewGoroutines fails t when, grace after it is called, goroutines run
// that did not before (ids in before), or when one starts in the 1.1s after
// that (longer than the client's delay before a topology refresh it
// schedules: one scheduled from a goroutine Close did not wait for shows).
// It is the goleak-style check of Close: call it right after the stores'
// Close returned.
func noNewGoroutines(t *testing.T, before map[int]string, grace time.Duration) {
	t.Helper()
	start := time.Now()
	var clean time.Time
	for ; ; time.Sleep(5 * time.Millisecond) {
		var extra []string
		for id, g := range goroutines() {
			if _, ok := before[id]; !ok && !strings.Contains(g, "noNewGoroutines") {
				extra = append(extra, g)
			}
		}
		switch {
		case len(extra) > 0 && (!clean.IsZero() || time.Since(start) > grace):
			var b strings.Builder
			_ = pprof.Lookup("goroutine").WriteTo(&b, 1)
			t.Logf("goroutine profile:\n%s", b.String())
			require.Empty(t, extra, "goroutines run %v after Close (grace %v)", time.Since(start), grace)
			return
		case len(extra) == 0 && clean.IsZero():
			clean = time.Now()
		case len(extra) == 0 && time.Since(clean) > 1100*time.Millisecond:
			return
		}
	}
}

// closeGrace is how long after Close a store's goroutines may still be
// seen: the last instructions of goroutines Close saw end (a deferred
// unlock, a return), not sleeps.
const closeGrace = 100 * time.Millisecond

// TestCloseEndsGoroutines: once Close has returned, no goroutine of the
// store or of its client runs: after plain use, after a master was killed
// (the client schedules a topology refresh, up to 1s later) and after a
// failover (the client closes replaced connections 5s after a refresh).
func TestCloseEndsGoroutines(t *testing.T) {
	t.Run("plain", func(t *testing.T) {
		c := shared(t)
		before := goroutines()
		s, err := Open(context.Background(), Config{Addrs: c.addrs(), Namespace: "leak-plain", Fingerprint: 1})
		require.NoError(t, err)
		t.Cleanup(func() { s.Close() }) // when the test fails before its Close
		ks, ps := keysN(50, 30), payloads(50, 1000)
		putAll(t, s, ks, ps)
		require.Equal(t, 50, count(s.Get(context.Background(), ks, dstsN(50, 1000))))
		require.NoError(t, s.Clear(context.Background()))
		for i := range ks {
			s.PutAsync(ks[i], ps[i]) // in flight at Close
		}
		require.NoError(t, s.Close())
		noNewGoroutines(t, before, closeGrace)
	})
	t.Run("killed-master", func(t *testing.T) {
		c := newCluster(t, 3, 0, "")
		before := goroutines()
		s, err := Open(context.Background(), Config{Addrs: c.addrs(), Namespace: "leak-killed", Fingerprint: 1, Timeout: 300 * time.Millisecond})
		require.NoError(t, err)
		t.Cleanup(func() { s.Close() }) // when the test fails before its Close
		ks, ps := keysN(50, 31), payloads(50, 1000)
		putAll(t, s, ks, ps)
		c.kill(c.ports[0])
		require.Less(t, count(s.Get(context.Background(), ks, dstsN(50, 1000))), 50)
		putAll(t, s, ks, ps)
		start := time.Now()
		require.NoError(t, s.Close())
		t.Logf("Close took %v", time.Since(start))
		noNewGoroutines(t, before, closeGrace)
	})
	t.Run("failover", func(t *testing.T) {
		c := newCluster(t, 3, 1, "")
		before := goroutines()
		s, err := Open(context.Background(), Config{Addrs: c.addrs(), Namespace: "leak-failover", Fingerprint: 1, Timeout: 300 * time.Millisecond})
		require.NoError(t, err)
		t.Cleanup(func() { s.Close() }) // when the test fails before its Close
		ks, ps := keysN(50, 32), payloads(50, 1000)
		putAll(t, s, ks, ps)
		waitReplicated(t, c)
		c.kill(c.ports[0])
		require.Eventually(t, func() bool {
			return count(s.Get(context.Background(), ks, dstsN(50, 1000))) == 50
		}, 20*time.Second, 100*time.Millisecond, "a replica is promoted")
		start := time.Now()
		require.NoError(t, s.Close())
		t.Logf("Close took %v", time.Since(start))
		noNewGoroutines(t, before, closeGrace)
	})
	t.Run("never-connected", func(t *testing.T) {
		before := goroutines()
		s, err := Open(context.Background(), Config{Addrs: []string{"127.0.0.1:1"}, Namespace: "leak-never", Background: true,
			Timeout: 100 * time.Millisecond, ReconnectMin: 10 * time.Millisecond, ReconnectMax: 20 * time.Millisecond})
		require.NoError(t, err)
		require.Eventually(t, func() bool { return s.Stats().ConnectAttempts >= 3 }, 5*time.Second, 5*time.Millisecond)
		require.NoError(t, s.Close())
		noNewGoroutines(t, before, closeGrace)
	})
}

// TestBackgroundConnect: with Config.Background, a store opened before its
// cluster runs is not Available (puts dropped and Gets missed, counted as
// unavailable, the connect error reported), connects once the cluster is
// up, and then writes and reads.
func TestBackgroundConnect(t *testing.T) {
	needRedis(t)
	ports, err := freePorts(3)
	require.NoError(t, err)
	var addrs []string
	for _, p := range ports {
		addrs = append(addrs, "127.0.0.1:"+strconv.Itoa(p))
	}
	before := goroutines()
	s, err := Open(context.Background(), Config{Addrs: addrs, Namespace: "background", Fingerprint: 1, Background: true,
		Timeout: 200 * time.Millisecond, ReconnectMin: 20 * time.Millisecond, ReconnectMax: 200 * time.Millisecond})
	require.NoError(t, err)
	require.False(t, s.Available())
	ks, ps := keysN(20, 40), payloads(20, 5000)
	require.False(t, s.PutAsync(ks[0], ps[0]))
	require.Zero(t, count(s.Get(context.Background(), ks, make([][]byte, len(ks)))), "dsts are not looked at")
	require.Error(t, s.Clear(context.Background()))
	st := s.Stats()
	require.False(t, st.Available)
	require.EqualValues(t, 1, st.DroppedUnavailable)
	require.EqualValues(t, 1, st.Dropped)
	require.EqualValues(t, 20, st.Unavailable)
	require.EqualValues(t, 20, st.Misses)
	require.Contains(t, st.ConnectError, addrs[0][:len("127.0.0.1:")])
	require.GreaterOrEqual(t, st.ConnectAttempts, int64(1))

	c, err := startClusterOn(t.TempDir(), ports, 3, 0, "")
	require.NoError(t, err)
	t.Cleanup(c.stop)
	require.Eventually(t, s.Available, 20*time.Second, 10*time.Millisecond)
	st = s.Stats()
	require.True(t, st.Available)
	require.Empty(t, st.ConnectError)
	putAll(t, s, ks, ps)
	require.EqualValues(t, 20, s.Stats().Puts)
	ds := dstsN(20, 5000)
	require.Equal(t, 20, count(s.Get(context.Background(), ks, ds)))
	require.Equal(t, ps, ds)
	require.NoError(t, s.Clear(context.Background()))
	require.NoError(t, s.Close())
	noNewGoroutines(t, before, closeGrace)
}

// TestNotACluster: a plain redis-server (cluster mode off), given as the
// only address, is no cluster tier: Open fails, and a background store
// stays not Available, saying why, and connects once the address serves a
// cluster; its goroutines end with Close either way.
func TestNotACluster(t *testing.T) {
	needRedis(t)
	ports, err := freePorts(1)
	require.NoError(t, err)
	addr := "127.0.0.1:" + strconv.Itoa(ports[0])
	plain := exec.Command("redis-server", "--port", strconv.Itoa(ports[0]), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", t.TempDir())
	require.NoError(t, plain.Start())
	stopPlain := func() { _ = plain.Process.Kill(); _ = plain.Wait() }
	t.Cleanup(stopPlain)
	require.NoError(t, clustertest.WaitDial(ports[0], 5*time.Second))

	before := goroutines()
	_, err = Open(context.Background(), Config{Addrs: []string{addr}, Namespace: "plain", Timeout: 500 * time.Millisecond})
	require.ErrorContains(t, err, "not a Redis Cluster")
	s, err := Open(context.Background(), Config{Addrs: []string{addr}, Namespace: "plain", Fingerprint: 1, Background: true,
		Timeout: 500 * time.Millisecond, ReconnectMin: 20 * time.Millisecond, ReconnectMax: 100 * time.Millisecond})
	require.NoError(t, err)
	require.False(t, s.Available())
	require.Contains(t, s.Stats().ConnectError, "not a Redis Cluster")

	// The address becomes a one-node cluster holding every slot.
	stopPlain()
	dir := t.TempDir()
	node := exec.Command("redis-server", "--port", strconv.Itoa(ports[0]), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
		"--cluster-config-file", "nodes.conf", "--save", "", "--appendonly", "no", "--dir", dir)
	require.NoError(t, node.Start())
	c := &testCluster{dir: dir, ports: ports, procs: map[int]*exec.Cmd{ports[0]: node}, masters: 1}
	t.Cleanup(c.stop)
	require.NoError(t, clustertest.WaitDial(ports[0], 5*time.Second))
	out, err := c.cli(ports[0], "cluster", "addslotsrange", "0", "16383")
	require.NoError(t, err, out)
	require.NoError(t, c.waitOK(20*time.Second))
	require.Eventually(t, s.Available, 20*time.Second, 10*time.Millisecond)
	ks, ps := keysN(4, 60), payloads(4, 1000)
	putAll(t, s, ks, ps)
	ds := dstsN(4, 1000)
	require.Equal(t, 4, count(s.Get(context.Background(), ks, ds)))
	require.Equal(t, ps, ds)
	require.NoError(t, s.Close())
	noNewGoroutines(t, before, closeGrace)
}

// hasUnlabelledRefresh finds a delayed refresh without a label in a
// goroutine profile, and only there.
func TestHasUnlabelledRefresh(t *testing.T) {
	labelled := "1 @ 0x1 0x2\n# labels: {\"kvoffload-cluster-store\":\"7\"}\n#\t0x1\tgithub.com/redis/rueidis.(*call).DelayDo.func1+0x3a\t/x/singleflight.go:69\n"
	bare := "1 @ 0x1 0x2\n#\t0x1\tgithub.com/redis/rueidis.(*call).DelayDo.func1+0x3a\t/x/singleflight.go:69\n"
	other := "2 @ 0x3\n#\t0x3\truntime.gopark+0x1\t/x/proc.go:1\n"
	require.False(t, hasUnlabelledRefresh([]byte("goroutine profile: total 3\n"+labelled+"\n"+other)))
	require.True(t, hasUnlabelledRefresh([]byte("goroutine profile: total 3\n"+other+"\n"+bare)))
	require.False(t, hasUnlabelledRefresh(nil))
}
