package main

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"

	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
	"github.com/kvoffload/kvoffload/internal/nodepool"
	"github.com/kvoffload/kvoffload/offload"
	"github.com/kvoffload/kvoffload/offload/hostsim"
)

// tinyDemo is a demo small enough for a unit test on two cores.
func tinyDemo(backend offload.Backend) demoConfig {
	c := defaultDemoConfig()
	c.duration = 2 * time.Second
	c.layoutName = "tiny"
	c.poolBytes = 2 << 20
	c.gpuBlocks = 64
	c.backend = backend
	c.pinning = string(offload.PinNone)
	return c
}

func noNotice(string) {}

func requireConsistent(t *testing.T, rep *demoReport) {
	t.Helper()
	b := rep.Blocks
	require.Equal(t, b.Total, b.GPUHits+b.HostHits+b.DiskHits+b.ClusterHits+b.Misses, "every block is a GPU hit, a host hit, a disk hit, a cluster hit or a miss")
	require.Equal(t, rep.Load.Blocks, b.HostHits+b.DiskHits+b.ClusterHits)
	require.Equal(t, rep.Store.Blocks*rep.BlockBytes, rep.Store.Bytes)
	require.Equal(t, rep.Store.Bytes, rep.EngineStoreBytes, "the demo and the engine agree on bytes stored")
	require.Equal(t, rep.Load.Bytes, rep.EngineLoadBytes, "the demo and the engine agree on bytes loaded")
	require.LessOrEqual(t, rep.UsedBytes, rep.PinnedBytes)
}

func TestDemoHostPasses(t *testing.T) {
	for _, kind := range []offload.LayoutKind{offload.LayoutLayerSeparate, offload.LayoutCrossLayer} {
		t.Run(string(kind), func(t *testing.T) {
			cfg := tinyDemo(offload.BackendHost)
			cfg.layoutKind = kind
			rep, err := runDemo(context.Background(), cfg, nil, noNotice)
			require.NoError(t, err)
			require.Positive(t, rep.Requests)
			require.Positive(t, rep.Blocks.GPUHits)
			require.Positive(t, rep.Blocks.HostHits, "the trace must reuse prefixes evicted from the GPU")
			require.Positive(t, rep.Blocks.Misses)
			require.Positive(t, rep.Verified)
			require.Zero(t, rep.VerifyFailures)
			require.Equal(t, rep.Load.Blocks, rep.Verified)
			requireConsistent(t, rep)
		})
	}
}

// TestDemoDisk: with a pool smaller than the working set and the disk
// tier, evicted blocks are written back and loaded from disk, and every
// loaded block verifies.
func TestDemoDisk(t *testing.T) {
	cfg := tinyDemo(offload.BackendHost)
	cfg.diskDir = t.TempDir()
	rep, err := runDemo(context.Background(), cfg, nil, noNotice)
	require.NoError(t, err)
	require.NotNil(t, rep.Disk)
	require.Positive(t, rep.Disk.Writes, "pool evictions were written back")
	require.Positive(t, rep.Blocks.DiskHits, "blocks were loaded from disk")
	require.Positive(t, rep.Disk.Hits, "the engine promoted blocks")
	require.Zero(t, rep.VerifyFailures)
	require.Equal(t, rep.Load.Blocks, rep.Verified)
	requireConsistent(t, rep)
	var out strings.Builder
	require.NoError(t, rep.print(&out))
	require.Contains(t, out.String(), "disk tier")
}

// TestDemoDiskRestart: a run with --disk stores its GPU cache at the end
// and Close writes the pool to disk, so a second run on the same
// directory (the same trace) loads its first request from disk instead of
// recomputing it.
func TestDemoDiskRestart(t *testing.T) {
	cfg := tinyDemo(offload.BackendHost)
	cfg.diskDir = t.TempDir()
	// A disk tier the run cannot fill (the default, four times the pool,
	// holds 409 tiny records and a 2 s run writes thousands: the first
	// request's records survived only when its prefix came back late).
	cfg.diskBytes = 512 << 20
	first, err := runDemo(context.Background(), cfg, nil, noNotice)
	require.NoError(t, err)
	require.Positive(t, first.Drained)
	require.Less(t, first.Disk.Records, first.Disk.Capacity, "the disk tier never filled: no record of the first request was evicted")
	require.NotNil(t, first.FirstRequest)
	require.Equal(t, first.FirstRequest.Total, first.FirstRequest.Misses, "a fresh directory: the first request is recomputed")
	second, err := runDemo(context.Background(), cfg, nil, noNotice)
	require.NoError(t, err)
	f := second.FirstRequest
	require.NotNil(t, f)
	require.Positive(t, f.DiskHits, "the second run hits the disk from its first request")
	require.Zero(t, f.Misses, "every block of the first request was on disk")
	require.Zero(t, second.VerifyFailures)
	var out strings.Builder
	require.NoError(t, second.print(&out))
	require.Contains(t, out.String(), "first request")
}

// TestDemoDiskDirs: --disk takes DIR[,DIR]: each directory gets a records
// file; an empty name is a usage error.
func TestDemoDiskDirs(t *testing.T) {
	cfg := tinyDemo(offload.BackendHost)
	a, b := t.TempDir(), t.TempDir()
	cfg.diskDir = a + "," + b
	rep, err := runDemo(context.Background(), cfg, nil, noNotice)
	require.NoError(t, err)
	require.Positive(t, rep.Disk.Writes)
	require.Zero(t, rep.VerifyFailures)
	for _, d := range []string{a, b} {
		files, err := filepath.Glob(filepath.Join(d, "records-*.kvo"))
		require.NoError(t, err)
		require.Len(t, files, 1, "a records file in %s", d)
	}
	cfg.diskDir = a + ",," + b
	_, err = runDemo(context.Background(), cfg, nil, noNotice)
	require.ErrorIs(t, err, errUsage)
}

func TestDemoDetectsCorruption(t *testing.T) {
	cfg := tinyDemo(offload.BackendHost)
	cfg.corruptLoads = 3
	rep, err := runDemo(context.Background(), cfg, nil, noNotice)
	require.ErrorIs(t, err, errVerification)
	require.NotNil(t, rep)
	require.Equal(t, int64(3), rep.VerifyFailures)
	require.NotEmpty(t, rep.FirstFailure)
}

func TestDemoRequestBound(t *testing.T) {
	cfg := tinyDemo(offload.BackendHost)
	cfg.duration, cfg.requests = 0, 25
	rep, err := runDemo(context.Background(), cfg, nil, noNotice)
	require.NoError(t, err)
	require.Equal(t, 25, rep.Requests)
}

func TestDemoInterrupted(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var notes []string
	rep, err := runDemo(ctx, tinyDemo(offload.BackendHost), nil, func(s string) { notes = append(notes, s) })
	require.NoError(t, err)
	require.Zero(t, rep.Requests)
	require.True(t, rep.Interrupted)
	require.Contains(t, fmt.Sprint(notes), "interrupted")
}

func TestDemoCommandJSON(t *testing.T) {
	code, out, errs := runCLI(t, "demo", "--json", "--backend", "host", "--layout", "tiny", "--pool-bytes", "1MiB",
		"--gpu-blocks", "32", "--requests", "30", "--duration", "0", "--pinning", "none", "--seed", "7")
	require.Equal(t, exitOK, code, errs)
	var rep demoReport
	require.NoError(t, json.Unmarshal([]byte(out), &rep))
	require.Equal(t, 30, rep.Requests)
	require.Equal(t, offload.BackendHost, rep.Backend)
	require.Equal(t, int64(1<<20), rep.PoolBytes)
	requireConsistent(t, &rep)

	code, out, _ = runCLI(t, "demo", "--backend", "host", "--layout", "tiny", "--pool-bytes", "1MiB",
		"--gpu-blocks", "32", "--requests", "10", "--duration", "0")
	require.Equal(t, exitOK, code)
	for _, w := range []string{"prefix hit ratio", "GB/s", "op latency", "CPU time per block", "pool: owned vs used", "verification", "PASS"} {
		require.Contains(t, out, w)
	}
	require.NotContains(t, out, "bounce copies", "a host-backend report has no bounce copies row")
	var b strings.Builder
	require.NoError(t, (&demoReport{Backend: "cuda", BounceCopies: 42, Verify: true}).print(&b))
	require.Contains(t, b.String(), "bounce copies")
	require.Contains(t, b.String(), "42 batches (of whole blocks gathered or scattered")
}

func TestDemoCUDABackendWithoutDriverFails(t *testing.T) {
	if _, err := defaultProber().load(); err == nil {
		t.Skip("a CUDA driver is present")
	}
	code, _, errs := runCLI(t, "demo", "--backend", "cuda", "--layout", "tiny", "--requests", "1")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "driver not available")
}

// TestKVMemoryVerify checks both memories against content written by
// recompute, and that a changed byte is caught.
func TestKVMemoryVerify(t *testing.T) {
	lay := cacheLayout{shape: layoutPresets["tiny"], kind: offload.LayoutLayerSeparate, blocks: 8}
	keys := make([]offload.Key, 4)
	for i := range keys {
		keys[i][0], keys[i][15] = byte(i+1), 0xAB
	}
	ids := []int{5, 0, 7, 2}

	drv := cudafake.New(cudafake.Options{})
	defer func() { require.NoError(t, drv.Close()) }()
	cm, err := newCUDAMemory(drv, 0, lay)
	require.NoError(t, err)
	sim, err := hostsim.NewGPU(hostsim.Options{})
	require.NoError(t, err)
	defer func() { require.NoError(t, sim.Close()) }()
	hm, err := newHostMemory(sim, lay)
	require.NoError(t, err)

	for name, m := range map[string]kvMemory{"cuda": cm, "host": hm} {
		t.Run(name, func(t *testing.T) {
			require.NoError(t, m.recompute(ids, keys))
			bad, err := m.verify(ids, keys)
			require.NoError(t, err)
			require.Empty(t, bad)
			swapped := []offload.Key{keys[1], keys[0], keys[2], keys[3]}
			bad, err = m.verify(ids, swapped)
			require.NoError(t, err)
			require.Equal(t, []int{0, 1}, bad, "a block holding another key's content fails")
			require.NoError(t, m.corrupt(ids[2]))
			bad, err = m.verify(ids, keys)
			require.NoError(t, err)
			require.Equal(t, []int{2}, bad)
			require.NoError(t, m.close())
		})
	}
	require.True(t, drv.Live().IsZero(), "the CUDA memory released everything: %+v", drv.Live())
}

// TestGPUCacheProperties drives the GPU cache's LRU with random requests
// and checks that its bookkeeping stays consistent, that a request's cached
// prefix is never evicted for it, and that the cached keys stay closed
// under prefixes.
func TestGPUCacheProperties(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		blocks := rapid.IntRange(1, 16).Draw(t, "blocks")
		c := newGPUCache(blocks)
		chains := make([][]offload.Key, 4)
		for i := range chains {
			for j := range blocks {
				var k offload.Key
				k[0], k[1] = byte(i), byte(j)
				chains[i] = append(chains[i], k)
			}
		}
		parent := map[offload.Key]offload.Key{}
		for _, ch := range chains {
			for j := 1; j < len(ch); j++ {
				parent[ch[j]] = ch[j-1]
			}
		}
		for range rapid.IntRange(1, 40).Draw(t, "requests") {
			ch := chains[rapid.IntRange(0, len(chains)-1).Draw(t, "chain")]
			keys := ch[:rapid.IntRange(1, blocks).Draw(t, "len")]
			g := c.prefix(keys)
			c.touchPrefix(keys[:g])
			rest := keys[g:]
			ids, victims, err := c.alloc(len(rest), g)
			if err != nil {
				t.Fatalf("alloc: %v", err)
			}
			for _, v := range victims {
				for _, k := range keys[:g] {
					if v.key == k {
						t.Fatalf("evicted %v of the request's own prefix", k)
					}
				}
			}
			for i := len(rest) - 1; i >= 0; i-- {
				c.insert(ids[i], rest[i])
			}
			c.touchPrefix(keys[:g])
			seen := 0
			for id := c.head; id >= 0; id = c.next[id] {
				seen++
				if c.byKey[c.keyOf[id]] != id {
					t.Fatalf("block %d holds %v but the index says %d", id, c.keyOf[id], c.byKey[c.keyOf[id]])
				}
			}
			if seen != len(c.byKey) || seen+len(c.free) != blocks {
				t.Fatalf("%d linked, %d indexed, %d free of %d blocks", seen, len(c.byKey), len(c.free), blocks)
			}
			for k := range c.byKey {
				if p, ok := parent[k]; ok {
					if _, cached := c.byKey[p]; !cached {
						t.Fatalf("key %v cached without its parent", k)
					}
				}
			}
		}
	})
}

// TestDemoGPU runs the demo on the CUDA backend (GPU machine).
func TestDemoGPU(t *testing.T) {
	cudatest.Open(t)
	cfg := tinyDemo(offload.BackendCUDA)
	cfg.layoutName, cfg.poolBytes, cfg.gpuBlocks = "8b", 1<<30, 128
	rep, err := runDemo(context.Background(), cfg, nil, noNotice)
	require.NoError(t, err)
	require.Equal(t, offload.BackendCUDA, rep.Backend)
	require.Positive(t, rep.Verified)
	require.Zero(t, rep.VerifyFailures)
	requireConsistent(t, rep)
	t.Logf("%d requests, %d blocks verified, store %.1f GB/s, load %.1f GB/s", rep.Requests, rep.Verified, rep.Store.GBps, rep.Load.GBps)
}

// TestDemoConnect: `kvoffload demo --connect SOCKET` runs against a node
// pool (as `kvoffload serve` runs it): two demos at once share it, and a
// third with the same trace loads blocks the others stored, every loaded
// block verified.
func TestDemoConnect(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "node.sock")
	s, err := nodepool.NewServer(nodepool.ServerConfig{Socket: socket, PoolBytes: 4 << 20, RegionBytes: 1 << 20, PrefaultThreads: 1})
	require.NoError(t, err)
	served := make(chan error, 1)
	go func() { served <- s.Serve() }()
	defer func() {
		require.NoError(t, s.Close())
		require.NoError(t, <-served)
	}()
	args := []string{"demo", "--json", "--connect", socket, "--backend", "host", "--layout", "tiny", "--pool-bytes", "2MiB",
		"--gpu-blocks", "32", "--requests", "40", "--duration", "0", "--pinning", "none", "--seed", "3"}
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			code, out, errs := runCLI(t, args...)
			if code != exitOK {
				t.Errorf("demo --connect: exit %d: %s", code, errs)
				return
			}
			var rep demoReport
			if err := json.Unmarshal([]byte(out), &rep); err != nil {
				t.Error(err)
				return
			}
			if rep.Node != socket || rep.VerifyFailures != 0 || rep.Load.Blocks != rep.Verified {
				t.Errorf("report %+v", rep)
			}
		}()
	}
	wg.Wait()
	require.Positive(t, s.Stats().Cache.Ready, "the demos stored into the node")
	code, out, errs := runCLI(t, args...)
	require.Equal(t, exitOK, code, errs)
	var rep demoReport
	require.NoError(t, json.Unmarshal([]byte(out), &rep))
	require.Positive(t, rep.Blocks.HostHits)
	require.Positive(t, rep.Verified)
	require.Zero(t, rep.VerifyFailures)
	code, _, errs = runCLI(t, "demo", "--connect", socket, "--disk", t.TempDir(), "--requests", "1", "--duration", "0")
	require.Equal(t, exitUsage, code, errs)
}
