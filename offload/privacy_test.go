package offload

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/kvoffload/kvoffload/mmapmem"
)

// mappingPath returns the pathname /proc/self/maps shows for the mapping
// holding addr ("" for anonymous memory).
func mappingPath(t *testing.T, addr uintptr) string {
	t.Helper()
	f, err := os.Open("/proc/self/maps")
	require.NoError(t, err)
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		lo, hi, _ := strings.Cut(fields[0], "-")
		a, err1 := strconv.ParseUint(lo, 16, 64)
		b, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil || uint64(addr) < a || uint64(addr) >= b {
			continue
		}
		if len(fields) >= 6 {
			return strings.Join(fields[5:], " ")
		}
		return ""
	}
	t.Fatalf("address %#x is not mapped", addr)
	return ""
}

// TestPoolMemoryPrivate: every region the engine holds KV in (pool regions
// grown in the background, and staging) is anonymous memory — no file,
// nothing under /dev/shm, no memfd another process could open through
// /proc/PID/fd — excluded from core dumps (MADV_DONTDUMP) and from a
// fork's child (MADV_DONTFORK).
func TestPoolMemoryPrivate(t *testing.T) {
	e := newTestEngine(t, Config{PoolBytes: 256 << 10, FirstRegionBytes: 64 << 10, RegionBytes: 64 << 10,
		StagingBytes: 16 << 10, Layout: smallLayout(8)})
	defer func() { require.NoError(t, e.Close()) }()
	require.NoError(t, e.WaitGrown(context.Background()))
	e.memory.mu.Lock()
	regions := append([]*poolRegion{e.stage.region}, e.memory.regions...)
	e.memory.mu.Unlock()
	require.Len(t, regions, 5)
	for i, pr := range regions {
		addr := pr.r.Addr()
		flags, err := mmapmem.VMAFlags(addr)
		require.NoError(t, err)
		require.Contains(t, flags, "dd", "region %d: MADV_DONTDUMP", i)
		require.Contains(t, flags, "dc", "region %d: MADV_DONTFORK", i)
		path := mappingPath(t, addr)
		require.Empty(t, path, "region %d is anonymous memory, not %q", i, path)
	}
}

// slotOf returns the pool bytes of the slot holding key (which must be ready).
func slotOf(t *testing.T, e *Engine, k Key) []byte {
	t.Helper()
	n, slots := e.cache.LookupLease([]Key{k}, nil)
	require.Equal(t, 1, n)
	require.NoError(t, e.cache.Unlease(slots))
	return regionBytes(e, slots[0])
}

func regionBytes(e *Engine, s kvcache.Slot) []byte {
	e.memory.mu.Lock()
	defer e.memory.mu.Unlock()
	for _, pr := range e.memory.regions {
		if pr.id == s.Region {
			return pr.r.Bytes()[s.Off : s.Off+uint64(e.slot)]
		}
	}
	return nil
}

func allZero(b []byte) bool { return !slices.ContainsFunc(b, func(x byte) bool { return x != 0 }) }

// TestZeroOnRelease: with Config.ZeroOnRelease a slot is zeroed when its
// block is deleted (a leased one only once its lease ends) or evicted, and
// a slot reused after eviction holds exactly its new block; without the
// option the bytes stay until the slot is reused.
func TestZeroOnRelease(t *testing.T) {
	for _, zero := range []bool{false, true} {
		t.Run(fmt.Sprint("zero=", zero), func(t *testing.T) {
			// Four slots, LRU: the fifth store evicts the oldest block.
			e := newTestEngine(t, Config{PoolBytes: 4 * 8 << 10, Layout: smallLayout(8), Policy: PolicyLRU, ZeroOnRelease: zero})
			defer func() { require.NoError(t, e.Close()) }()
			ctx := context.Background()
			contents := make([][]byte, 5)
			for i := range 4 {
				contents[i] = fillBlock(t, e, i, byte(10+i))
			}
			op, err := e.Store(ctx, seqKeys(0, 4), seqIDs(0, 4), StoreOptions{})
			require.NoError(t, err)
			require.NoError(t, op.Wait(ctx))
			slots := make([][]byte, 4)
			for i := range 4 {
				slots[i] = slotOf(t, e, testKey(i))
				require.Equal(t, contents[i], slots[i])
			}

			n, err := e.Delete([]Key{testKey(0)})
			require.NoError(t, err)
			require.Equal(t, 1, n)
			require.Equal(t, zero, allZero(slots[0]), "deleted block's slot")

			res, err := e.Lookup([]Key{testKey(1)}, LookupOptions{Lease: true})
			require.NoError(t, err)
			_, err = e.Delete([]Key{testKey(1)})
			require.NoError(t, err)
			require.Equal(t, contents[1], slots[1], "a leased block is not zeroed under its reader")
			require.NoError(t, res.Lease.Release())
			require.Equal(t, zero, allZero(slots[1]), "deleted block's slot once its lease ended")

			// Two more stores fill the freed slots; a third evicts a block.
			for i := 4; i < 7; i++ {
				contents = append(contents[:i], fillBlock(t, e, i-4, byte(20+i)))
				op, err := e.Store(ctx, []Key{testKey(i)}, []int{i - 4}, StoreOptions{})
				require.NoError(t, err)
				require.NoError(t, op.Wait(ctx))
				require.Equal(t, 1, op.count(OutcomeStored))
			}
			present := 0
			for i := 2; i < 7; i++ {
				if r, err := e.Lookup([]Key{testKey(i)}, LookupOptions{}); err != nil || r.Hits == 0 {
					continue
				}
				present++
				require.Equal(t, contents[i], slotOf(t, e, testKey(i)), "key %d", i)
				op, err := e.Load(ctx, []Key{testKey(i)}, []int{7}, LoadOptions{})
				require.NoError(t, err)
				require.NoError(t, op.Wait(ctx))
				require.Equal(t, contents[i], blockBytes(e, 7), "key %d loads byte-exact", i)
			}
			require.Equal(t, 4, present, "one of keys 2..6 was evicted")
			if zero {
				require.Equal(t, int64(3), e.Stats().Pool.ZeroedSlots, "two deletes and one eviction")
			} else {
				require.Zero(t, e.Stats().Pool.ZeroedSlots)
			}
		})
	}
}

// BenchmarkZeroOnRelease measures what ZeroOnRelease adds to releasing a
// block: Delete of 64 stored 2 MiB blocks (an 8B-class model's block),
// with and without zeroing. It reports ns/block of the Delete and, for the
// zeroing run, the zeroing rate in GB/s (bytes zeroed over the time the
// Delete took more than without zeroing, measured in the same run).
func BenchmarkZeroOnRelease(b *testing.B) {
	const blocks = 64
	layout := LayoutSpec{Kind: LayoutCrossLayer, Layers: 32, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: blocks}
	var base float64
	for _, zero := range []bool{false, true} {
		b.Run(fmt.Sprint("zero=", zero), func(b *testing.B) {
			e, err := newEngine(Config{PoolBytes: blocks * 2 << 20, FirstRegionBytes: blocks * 2 << 20, Layout: layout,
				Backend: BackendHost, SkipMemoryCheck: true, ZeroOnRelease: zero, StagingBytes: -1, Policy: PolicyLRU}, engineHooks{})
			require.NoError(b, err)
			defer func() { require.NoError(b, e.Close()) }()
			ctx := context.Background()
			keys := seqKeys(0, blocks)
			var elapsed, released int64
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				op, err := e.Store(ctx, keys, seqIDs(0, blocks), StoreOptions{})
				require.NoError(b, err)
				require.NoError(b, op.Wait(ctx))
				require.NoError(b, op.Release())
				b.StartTimer()
				t0 := time.Now()
				n, err := e.Delete(keys)
				elapsed += int64(time.Since(t0))
				require.NoError(b, err)
				released += int64(n)
			}
			perBlock := float64(elapsed) / float64(released)
			b.ReportMetric(perBlock, "ns/block")
			if !zero {
				base = perBlock
				return
			}
			if extra := perBlock - base; base > 0 && extra > 0 {
				b.ReportMetric(float64(e.slot)/extra, "zero-GB/s")
			}
		})
	}
}

// BenchmarkZeroOnReleaseContention measures what ZeroOnRelease costs other
// callers: lookups (of one stored 2 MiB block) on the benchmark goroutine
// while another goroutine stores and deletes 64 blocks in a loop, with and
// without zeroing. Zeroing runs outside the cache's lock, so a lookup
// should not wait for it; it reports the lookups' mean and worst latency
// and how many blocks were zeroed meanwhile.
func BenchmarkZeroOnReleaseContention(b *testing.B) {
	const blocks = 64
	layout := LayoutSpec{Kind: LayoutCrossLayer, Layers: 32, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: blocks + 1}
	for _, zero := range []bool{false, true} {
		b.Run(fmt.Sprint("zero=", zero), func(b *testing.B) {
			// Room for the churn, the probe and the low watermark: the probe is
			// never evicted.
			const pool = (blocks + 4) * 2 << 20
			e, err := newEngine(Config{PoolBytes: pool, FirstRegionBytes: pool, Layout: layout,
				Backend: BackendHost, SkipMemoryCheck: true, ZeroOnRelease: zero, StagingBytes: -1, Policy: PolicyLRU}, engineHooks{})
			require.NoError(b, err)
			defer func() { require.NoError(b, e.Close()) }()
			ctx := context.Background()
			probe := []Key{testKey(blocks)}
			op, err := e.Store(ctx, probe, []int{blocks}, StoreOptions{})
			require.NoError(b, err)
			require.NoError(b, op.Wait(ctx))
			require.NoError(b, op.Release())

			stop := make(chan struct{})
			churned := make(chan error, 1)
			go func() {
				keys := seqKeys(0, blocks)
				for {
					select {
					case <-stop:
						churned <- nil
						return
					default:
					}
					op, err := e.Store(ctx, keys, seqIDs(0, blocks), StoreOptions{})
					if err == nil {
						err = op.Wait(ctx)
						_ = op.Release()
					}
					if err == nil {
						_, err = e.Delete(keys)
					}
					if err != nil {
						churned <- err
						return
					}
				}
			}()
			zeroedBefore := e.Stats().Pool.ZeroedSlots
			var total, worst time.Duration
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				t0 := time.Now()
				r, err := e.Lookup(probe, LookupOptions{})
				d := time.Since(t0)
				if err != nil || r.Hits != 1 {
					b.Fatalf("lookup of the probe block: hits %d, err %v", r.Hits, err)
				}
				total += d
				worst = max(worst, d)
			}
			b.StopTimer()
			close(stop)
			require.NoError(b, <-churned)
			b.ReportMetric(float64(total.Nanoseconds())/float64(b.N), "ns/lookup")
			b.ReportMetric(float64(worst.Nanoseconds()), "worst-ns/lookup")
			b.ReportMetric(float64(e.Stats().Pool.ZeroedSlots-zeroedBefore)/float64(b.N), "zeroed/lookup")
		})
	}
}
