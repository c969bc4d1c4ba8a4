package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/tier/cluster/clustertest"
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
		out, errs := run("--json")
		var rep demoReport
		require.NoError(t, json.Unmarshal([]byte(out), &rep), errs)
		requireConsistent(t, &rep)
		require.NotNil(t, rep.Cluster)
		require.Empty(t, rep.Cluster.Error)
		require.Zero(t, rep.VerifyFailures)
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
