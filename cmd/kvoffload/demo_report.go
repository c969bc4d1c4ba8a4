package main

import (
	"bytes"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/kvoffload/kvoffload/offload"
)

// demoReport is the demo's result, printed as a table or as JSON.
type demoReport struct {
	Backend       offload.Backend    `json:"backend"`
	BackendReason string             `json:"backend_reason"`
	Layout        string             `json:"layout"`
	LayoutKind    offload.LayoutKind `json:"layout_kind"`
	BlockBytes    int64              `json:"block_bytes"`
	GPUBlocks     int                `json:"gpu_blocks"`
	PoolBytes     int64              `json:"pool_bytes"`
	Pinning       string             `json:"pinning"`
	Policy        offload.Policy     `json:"policy"`
	Verify        bool               `json:"verify"`
	// Node is the node pool's socket (--connect), "" for a pool of the
	// engine's own.
	Node string `json:"node,omitempty"`
	// NodeReconnects is how many times the engine reconnected to its node
	// (--connect) after it went away: node restarts during the run.
	NodeReconnects int `json:"node_reconnects,omitempty"`
	// FirstNodeError is the first error of the node gone (unavailable):
	// the blocks it concerned are counted Unavailable and recomputed.
	FirstNodeError string `json:"first_node_error,omitempty"`

	// Interrupted: a signal (or the caller) ended the run before its
	// --duration or --requests; the report covers what ran.
	Interrupted       bool        `json:"interrupted"`
	Seconds           float64     `json:"seconds"`
	Requests          int         `json:"requests"`
	RequestsTruncated int         `json:"requests_truncated"` // longer than the GPU cache: cut to it
	Blocks            blockCounts `json:"blocks"`
	// FirstRequest is the first request's share of Blocks: with --disk, a
	// second run on the same directory loads it from disk.
	FirstRequest *blockCounts `json:"first_request,omitempty"`
	// Drained are the GPU cache's blocks stored at the end of a run with
	// --disk (a graceful shutdown's offload), so that Close writes them to
	// disk with the rest of the pool (DiskConfig.WriteBackOnClose).
	Drained int64 `json:"drained,omitempty"`

	Store directionReport `json:"store"`
	Load  directionReport `json:"load"`
	// EngineStoreBytes and EngineLoadBytes are the engine's own byte
	// counters (Stats), for comparison with Store.Bytes and Load.Bytes.
	EngineStoreBytes int64 `json:"engine_store_bytes"`
	EngineLoadBytes  int64 `json:"engine_load_bytes"`
	Evictions        int64 `json:"pool_evictions"`
	// BounceCopies is the engine's Stats.Copies.Bounced: copy batches of
	// whole blocks bounced through device chunks by the DMA engines (CUDA).
	BounceCopies int64 `json:"bounce_copies"`

	// CPUSeconds is the process's CPU time while stores and loads were in
	// flight; CPUMicrosPerBlock divides it by the blocks moved.
	CPUSeconds        float64 `json:"cpu_seconds"`
	CPUMicrosPerBlock float64 `json:"cpu_us_per_block"`
	// PinnedBytes is the pool memory owned (mapped and pinned) at the end;
	// UsedBytes the part holding blocks.
	PinnedBytes int64 `json:"pinned_bytes"`
	UsedBytes   int64 `json:"used_bytes"`

	RecomputeSeconds float64 `json:"recompute_seconds"`
	VerifySeconds    float64 `json:"verify_seconds"`
	Verified         int64   `json:"verified_blocks"`
	VerifyFailures   int64   `json:"verify_failures"`
	FirstFailure     string  `json:"first_failure,omitempty"`
	FirstEngineError string  `json:"first_engine_error,omitempty"`

	// Disk is the disk tier (--disk), nil without one.
	Disk *diskReport `json:"disk,omitempty"`
	// Cluster is the cluster tier (--redis), nil without one.
	Cluster *clusterReport `json:"cluster,omitempty"`
}

// diskReport is the engine's disk-tier counters at the end of the run.
type diskReport struct {
	Dir         string `json:"dir"`
	Mode        string `json:"mode"`
	Records     int64  `json:"records"`
	Bytes       int64  `json:"bytes"`
	Capacity    int64  `json:"capacity_records"`
	Writes      int64  `json:"writes"`
	WriteErrors int64  `json:"write_errors"`
	Dropped     int64  `json:"dropped"`
	NotAdmitted int64  `json:"not_admitted"`
	Hits        int64  `json:"hits"`
	Misses      int64  `json:"misses"`
	Corrupt     int64  `json:"corrupt"`
}

// blockCounts splits the blocks of every request by where they came from.
type blockCounts struct {
	Total    int64 `json:"total"`
	GPUHits  int64 `json:"gpu_hits"`  // already in the GPU cache
	HostHits int64 `json:"host_hits"` // loaded from the host pool
	// DiskHits are the blocks loaded past the host prefix, in the prefix
	// Lookup found on disk (LookupResult.DiskHits): promoted from disk, or
	// already in the pool behind a block that was on disk only.
	DiskHits int64 `json:"disk_hits"`
	// ClusterHits are the blocks loaded past those, which Prefetch
	// promoted from the cluster (--redis) just before the load.
	ClusterHits int64 `json:"cluster_hits"`
	Misses      int64 `json:"misses"` // recomputed
}

func (b blockCounts) ratio(n int64) float64 {
	if b.Total == 0 {
		return 0
	}
	return float64(n) / float64(b.Total)
}

// directionReport is one copy direction as the demo saw it: op latency is
// call → done, and GB/s is bytes over the summed latencies (busy time).
type directionReport struct {
	Ops            int64   `json:"ops"`
	Blocks         int64   `json:"blocks"` // stored or loaded
	Bytes          int64   `json:"bytes"`
	Seconds        float64 `json:"seconds"`
	GBps           float64 `json:"gb_per_s"`
	P50us          float64 `json:"p50_us"`
	P99us          float64 `json:"p99_us"`
	AlreadyPresent int64   `json:"already_present,omitempty"`
	// Store refusals: no free slot, or the policy's admission declined.
	RefusedFull      int64 `json:"refused_full,omitempty"`
	RefusedAdmission int64 `json:"refused_admission,omitempty"`
	Missing          int64 `json:"missing,omitempty"`
	Busy             int64 `json:"busy,omitempty"`
	// Unavailable counts the blocks of ops that met the node gone
	// (--connect): stores it did not commit, loads it could not serve.
	// They are recomputed; a node restart is not a failed copy.
	Unavailable int64 `json:"unavailable,omitempty"`
	Failed      int64 `json:"failed"`
}

func (r *demoReport) print(w io.Writer) error {
	var b bytes.Buffer
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	row := func(k, format string, args ...any) { fmt.Fprintf(tw, "%s\t"+format+"\n", append([]any{k}, args...)...) }
	row("backend", "%s (%s)", r.Backend, r.BackendReason)
	if r.Node != "" {
		row("node pool", "%s (offload.Dial: the index and pool are the node's)", r.Node)
		if r.NodeReconnects > 0 || r.Store.Unavailable+r.Load.Unavailable > 0 {
			row("  node restarts", "%d (reconnected); blocks met with the node gone, recomputed: %d stores not committed, %d loads; first: %s",
				r.NodeReconnects, r.Store.Unavailable, r.Load.Unavailable, r.FirstNodeError)
		}
	}
	row("layout", "%s %s, %s blocks, %d GPU blocks (%s), pool %s (%s), policy %s", r.Layout, r.LayoutKind,
		formatSize(r.BlockBytes), r.GPUBlocks, formatSize(int64(r.GPUBlocks)*r.BlockBytes), formatSize(r.PoolBytes), r.Pinning, r.Policy)
	trunc := ""
	if r.RequestsTruncated > 0 {
		trunc = fmt.Sprintf(" (%d cut to the GPU cache)", r.RequestsTruncated)
	}
	if r.Interrupted {
		trunc += "; interrupted before the end: this reports what ran"
	}
	row("requests", "%d in %.1f s%s", r.Requests, r.Seconds, trunc)
	bl := r.Blocks
	if r.Disk != nil {
		row("prefix hit ratio", "GPU %.1f%%  host %.1f%%  disk %.1f%%  miss %.1f%%  (of %d blocks)", 100*bl.ratio(bl.GPUHits), 100*bl.ratio(bl.HostHits), 100*bl.ratio(bl.DiskHits), 100*bl.ratio(bl.Misses), bl.Total)
	} else {
		row("prefix hit ratio", "GPU %.1f%%  host %.1f%%  miss %.1f%%  (of %d blocks)", 100*bl.ratio(bl.GPUHits), 100*bl.ratio(bl.HostHits), 100*bl.ratio(bl.Misses), bl.Total)
	}
	for _, d := range []struct {
		name string
		d    directionReport
		also string
	}{
		{"stored (GPU→host)", r.Store, fmt.Sprintf("%d already present, refused %d (admission) %d (full) %d (busy)", r.Store.AlreadyPresent, r.Store.RefusedAdmission, r.Store.RefusedFull, r.Store.Busy)},
		{"loaded (host→GPU)", r.Load, fmt.Sprintf("%d missing, %d busy", r.Load.Missing, r.Load.Busy)},
	} {
		row(d.name, "%.3f GB in %d blocks, %.2f GB/s; %s; %d failed", float64(d.d.Bytes)/1e9, d.d.Blocks, d.d.GBps, d.also, d.d.Failed)
		row("  op latency", "p50 %s  p99 %s  (%d ops)", micros(d.d.P50us), micros(d.d.P99us), d.d.Ops)
	}
	row("CPU time per block", "%.1f µs (%.2f s while copies were in flight)", r.CPUMicrosPerBlock, r.CPUSeconds)
	if r.Backend == "cuda" {
		row("bounce copies", "%d batches (of whole blocks gathered or scattered through device chunks, moved by the DMA engines)", r.BounceCopies)
	}
	row("pool: owned vs used", "%s owned (%s), %s holding blocks (%d pool evictions)", formatSize(r.PinnedBytes), r.Pinning, formatSize(r.UsedBytes), r.Evictions)
	if d := r.Disk; d != nil {
		row("disk tier", "%s (%s): %d of %d records (%s); %d written back, %d dropped (write-back full), %d not admitted, %d write errors",
			d.Dir, d.Mode, d.Records, d.Capacity, formatSize(d.Bytes), d.Writes, d.Dropped, d.NotAdmitted, d.WriteErrors)
		row("  promoted", "%d blocks read back, %d misses (%d damaged)", d.Hits, d.Misses, d.Corrupt)
		if f := r.FirstRequest; f != nil {
			row("  first request", "%d blocks: %d GPU, %d host, %d disk, %d missed", f.Total, f.GPUHits, f.HostHits, f.DiskHits, f.Misses)
		}
		row("  at the end", "%d GPU blocks stored to the pool; Close writes the pool's blocks not on disk yet, for the next run", r.Drained)
	}
	r.Cluster.print(row, bl)
	row("recompute", "%.2f s", r.RecomputeSeconds)
	switch {
	case !r.Verify:
		row("verification", "off (--verify=false)")
	case r.VerifyFailures == 0:
		row("verification", "PASS: %d loaded blocks checked in %.2f s (apart from the copies)", r.Verified, r.VerifySeconds)
	default:
		row("verification", "FAIL: %d of %d loaded blocks wrong; first %s", r.VerifyFailures, r.Verified, r.FirstFailure)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := w.Write(b.Bytes())
	return err
}

// micros renders a duration given in µs with a readable unit.
func micros(us float64) string {
	switch {
	case us >= 1e6:
		return fmt.Sprintf("%.2f s", us/1e6)
	case us >= 1e3:
		return fmt.Sprintf("%.2f ms", us/1e3)
	}
	return fmt.Sprintf("%.0f µs", us)
}
