package metrics_test

import (
	"strings"
	"testing"

	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/kvoffload/kvoffload/metrics"
	"github.com/prometheus/common/expfmt"
	"github.com/stretchr/testify/require"
)

// TestNodeRegistry checks that every scrape reads the node's stats anew,
// and that the disk series come with disk only.
func TestNodeRegistry(t *testing.T) {
	st := metrics.NodeStats{PoolBytes: 8 << 20, FreedBytes: 4 << 20, Clients: 2, Cache: kvcache.Stats{Stored: 3},
		DiskOpen: true, DiskRecords: 5}
	text := func(disk bool) string {
		mfs, err := metrics.NodeRegistry(func() metrics.NodeStats { return st }, disk).Gather()
		require.NoError(t, err)
		var b strings.Builder
		enc := expfmt.NewEncoder(&b, expfmt.NewFormat(expfmt.TypeTextPlain))
		for _, mf := range mfs {
			require.NoError(t, enc.Encode(mf))
		}
		return b.String()
	}
	out := text(false)
	for _, want := range []string{"kvoffload_node_pool_bytes 4.194304e+06", "kvoffload_node_clients 2", "kvoffload_node_stored_total 3"} {
		require.Contains(t, out, want)
	}
	require.NotContains(t, out, "kvoffload_node_disk_")
	st.Cache.Stored = 4
	out = text(true)
	for _, want := range []string{"kvoffload_node_stored_total 4", "kvoffload_node_disk_up 1", "kvoffload_node_disk_records 5"} {
		require.Contains(t, out, want)
	}
}
