package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/tier/cluster/clustertest"
)

// TestDemoClusterTwoProcesses: two demo processes with one seed and
// --redis on one Redis Cluster: the first writes its blocks through, the
// second, starting with an empty pool, prefetches them and loads cluster
// hits, every loaded block verified by content.
func TestDemoClusterTwoProcesses(t *testing.T) {
	c := clustertest.Start(t, 3)
	args := []string{"demo", "--backend", "host", "--layout", "tiny", "--pool-bytes", "1MiB", "--gpu-blocks", "32",
		"--requests", "60", "--duration", "0", "--pinning", "none", "--seed", "11", "--redis", strings.Join(c.Addrs(), ",")}
	run := func(extra ...string) (string, string) {
		cmd, out, errs := startCLI(t, append(append([]string(nil), args...), extra...)...)
		require.NoError(t, cmd.Wait(), errs.String())
		return out.String(), errs.String()
	}
	report := func() demoReport {
		rep := clusterDemo(t, append(append([]string(nil), args...), "--json"))
		requireConsistent(t, &rep)
		require.Empty(t, rep.Cluster.Error)
		require.Equal(t, rep.Load.Blocks, rep.Verified, "every loaded block verified")
		return rep
	}
	first := report()
	require.Positive(t, first.Cluster.Writes, "the first process wrote through")
	require.Zero(t, first.Cluster.Dropped)
	second := report()
	require.Positive(t, second.Blocks.ClusterHits, "the second process loaded blocks the first wrote")
	require.Positive(t, second.Cluster.Hits)

	out, _ := run()
	for _, w := range []string{"cluster tier", "written through", "cluster hits loaded", "PASS"} {
		require.Contains(t, out, w)
	}
}

func TestDemoRedisFlagChecked(t *testing.T) {
	for _, bad := range []string{",", "host", "a:1,,b:2"} {
		_, err := redisAddrs(bad)
		require.ErrorIs(t, err, errUsage, bad)
	}
	addrs, err := redisAddrs("a:1, b:2")
	require.NoError(t, err)
	require.Equal(t, []string{"a:1", "b:2"}, addrs)
}

// TestDemoClusterAuth: on a cluster that requires a password, demo --redis
// without it writes nothing through (the tier never connects), with it
// from $KVOFFLOAD_REDIS_PASSWORD writes through, and as an ACL user
// (--redis-user) too. --redis-user and --redis-tls need --redis.
func TestDemoClusterAuth(t *testing.T) {
	c := clustertest.Start(t, 3)
	for _, p := range c.Ports() {
		out, err := clustertest.CLI(p, "", "acl", "setuser", "kvo", "on", ">userpw", "~*", "+@all")
		require.NoError(t, err, out)
		out, err = clustertest.CLI(p, "", "config", "set", "requirepass", "s3cret")
		require.NoError(t, err, out)
	}
	args := []string{"demo", "--backend", "host", "--layout", "tiny", "--pool-bytes", "1MiB", "--gpu-blocks", "32",
		"--requests", "20", "--duration", "0", "--pinning", "none", "--seed", "5", "--json", "--redis", strings.Join(c.Addrs(), ",")}
	report := func(extra ...string) demoReport {
		return clusterDemo(t, append(append([]string(nil), args...), extra...))
	}
	t.Setenv(redisPasswordEnv, "")
	rep := report()
	require.Zero(t, rep.Cluster.Writes, "no password: nothing written")
	require.False(t, rep.Cluster.Available)
	require.NotEmpty(t, rep.Cluster.Error)

	t.Setenv(redisPasswordEnv, "s3cret")
	rep = report()
	require.Positive(t, rep.Cluster.Writes, "the default user's password")
	require.True(t, rep.Cluster.Available)

	t.Setenv(redisPasswordEnv, "userpw")
	rep = report("--redis-user", "kvo", "--seed", "6")
	require.True(t, rep.Cluster.Available, "an ACL user: %+v", rep.Cluster)
	require.Positive(t, rep.Cluster.Writes+rep.Cluster.Hits, "an ACL user writes and reads: %+v", rep.Cluster)

	for _, flag := range [][]string{{"--redis-user", "kvo"}, {"--redis-tls"}, {"--redis-tls-ca", "ca.pem"}, {"--redis-tls-name", "n"}} {
		cmd, _, errs := startCLI(t, append([]string{"demo", "--backend", "host", "--layout", "tiny", "--requests", "1"}, flag...)...)
		require.Error(t, cmd.Wait())
		require.Contains(t, errs.String(), "need --redis")
	}
}

// TestDemoClusterTLS: demo --redis on a TLS-only cluster writes through
// with --redis-tls-ca (and --redis-tls-name) and not without the CA.
func TestDemoClusterTLS(t *testing.T) {
	c, files := clustertest.StartTLS(t, 3)
	report := func(extra ...string) demoReport {
		return clusterDemo(t, append([]string{"demo", "--backend", "host", "--layout", "tiny", "--pool-bytes", "1MiB", "--gpu-blocks", "32",
			"--requests", "30", "--duration", "0", "--pinning", "none", "--seed", "12", "--json", "--redis", strings.Join(c.Addrs(), ",")}, extra...))
	}
	rep := report("--redis-tls-ca", files.CA, "--redis-tls-name", clustertest.ServerName)
	require.True(t, rep.Cluster.Available, "%+v", rep.Cluster)
	require.Positive(t, rep.Cluster.Writes)
	rep = report("--redis-tls")
	require.False(t, rep.Cluster.Available, "the system's roots do not hold the test CA")
	require.Zero(t, rep.Cluster.Writes)
}

// clusterDemo runs the CLI with args (a demo with --json and --redis),
// requires it to succeed with a cluster report and no verification
// failure, and returns the report.
func clusterDemo(t *testing.T, args []string) demoReport {
	t.Helper()
	cmd, out, errs := startCLI(t, args...)
	require.NoError(t, cmd.Wait(), errs.String())
	var rep demoReport
	require.NoError(t, json.Unmarshal(out.Bytes(), &rep), errs.String())
	require.NotNil(t, rep.Cluster)
	require.Zero(t, rep.VerifyFailures)
	return rep
}
