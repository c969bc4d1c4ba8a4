package main

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/kvoffload/kvoffload/offload"
)

// clusterReport is the engine's cluster-tier counters at the end of the
// run (--redis).
type clusterReport struct {
	Addrs       []string `json:"addrs"`
	Writes      int64    `json:"writes"`       // blocks written through that the cluster stored
	WriteErrors int64    `json:"write_errors"` // write-throughs the cluster failed
	WriteOOM    int64    `json:"write_oom"`    // the write errors a full node refused (OOM)
	Dropped     int64    `json:"dropped"`      // write-throughs dropped (too many bytes in flight)
	Hits        int64    `json:"hits"`         // blocks Prefetch read from the cluster
	Misses      int64    `json:"misses"`       // blocks Prefetch asked for and did not get
	Promoted    int64    `json:"promoted"`     // blocks Prefetch promoted (cluster and disk)
	Available   bool     `json:"available"`    // connected at the end of the run
	Unavailable int64    `json:"unavailable"`  // write-throughs and Prefetch keys skipped while not connected
	Error       string   `json:"error,omitempty"`
}

// redisAddrs splits --redis's HOST:PORT[,HOST:PORT] list.
func redisAddrs(s string) ([]string, error) {
	if s == "" {
		return nil, nil
	}
	var out []string
	for _, a := range strings.Split(s, ",") {
		a = strings.TrimSpace(a)
		if a == "" || !strings.Contains(a, ":") {
			return nil, fmt.Errorf("%w: --redis %q: want HOST:PORT[,HOST:PORT...]", errUsage, s)
		}
		out = append(out, a)
	}
	return out, nil
}

// redisPasswordEnv holds the password --redis sends with AUTH (a flag
// would show it to every user of the machine in the process list).
const redisPasswordEnv = "KVOFFLOAD_REDIS_PASSWORD"

// clusterConfig is the engine's Config.Cluster for --redis (nil without).
func clusterConfig(cfg demoConfig) *offload.ClusterConfig {
	addrs, err := redisAddrs(cfg.redis)
	if err != nil || len(addrs) == 0 {
		return nil
	}
	return &offload.ClusterConfig{Addrs: addrs, Username: cfg.redisUser, Password: os.Getenv(redisPasswordEnv), TLS: cfg.redisTLS,
		TLSCAFile: cfg.redisTLSCA, TLSServerName: cfg.redisTLSName}
}

// prefetchCluster (--redis) prefetches rest[n:], the keys past the host and
// disk prefixes Lookup found, and returns how many of them now lead the
// host pool: the Load takes them too.
func (r *demoRun) prefetchCluster(rest []offload.Key, n int) (int, error) {
	if r.cfg.redis == "" || n >= len(rest) {
		return 0, nil
	}
	pr, err := r.eng.Prefetch(context.Background(), rest[n:], offload.PrefetchOptions{})
	if err != nil {
		return 0, err
	}
	r.clusterPromoted += int64(pr.Promoted)
	if pr.Promoted == 0 {
		return 0, nil
	}
	lr, err := r.eng.Lookup(rest[n:], offload.LookupOptions{})
	if err != nil {
		return 0, err
	}
	return lr.Hits, nil
}

// clusterReportOf fills the report's cluster section from the engine's stats.
func (r *demoRun) clusterReportOf(st offload.Stats) *clusterReport {
	if r.cfg.redis == "" {
		return nil
	}
	addrs, _ := redisAddrs(r.cfg.redis)
	return &clusterReport{Addrs: addrs, Writes: st.Cluster.Writes, WriteErrors: st.Cluster.WriteErrors, WriteOOM: st.Cluster.WriteOOM, Dropped: st.Cluster.Dropped,
		Hits: st.Cluster.Hits, Misses: st.Cluster.Misses, Promoted: r.clusterPromoted, Available: st.Cluster.Available,
		Unavailable: st.Cluster.Unavailable, Error: st.Cluster.Error}
}

// printCluster adds the cluster tier's rows to the text report.
func (c *clusterReport) print(row func(name, format string, args ...any), bl blockCounts) {
	if c == nil {
		return
	}
	state := strings.Join(c.Addrs, ",")
	if !c.Available {
		state += " (not connected: " + c.Error + ")"
	}
	row("cluster tier", "%s: %d written through, %d dropped, %d write errors (%d refused by a full node: OOM), %d skipped while not connected", state, c.Writes, c.Dropped, c.WriteErrors, c.WriteOOM, c.Unavailable)
	row("  prefetched", "%d blocks read, %d misses; %d cluster hits loaded (%.1f%% of %d blocks)", c.Hits, c.Misses, bl.ClusterHits, 100*bl.ratio(bl.ClusterHits), bl.Total)
}
