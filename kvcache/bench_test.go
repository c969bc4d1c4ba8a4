package kvcache

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvoffload/kvoffload/internal/trace"
)

// replay runs a trace through a cache the way the engine uses it: look up a
// request's chain, store the blocks after the hit prefix, complete them.
type replayResult struct {
	blocks, hits uint64
	st           Stats
}

func replay(b *testing.B, c *Cache, requests int) replayResult {
	tc := trace.Default
	tc.Seed = 1
	g, err := trace.New(tc)
	if err != nil {
		b.Fatal(err)
	}
	tpb := c.layout.Geometry().TokensPerBlock
	var r replayResult
	var keys []Key
	var ids []int
	var res []StoreResult
	var slots []Slot
	for i := 0; i < requests; i++ {
		req := g.Next()
		keys, _ = appendChainKeys(keys[:0], []byte("bench"), Key{}, req.Tokens, tpb)
		n := c.Lookup(keys)
		r.blocks += uint64(len(keys))
		r.hits += uint64(n)
		if n == len(keys) {
			continue
		}
		ids = ids[:0]
		for j := range keys[n:] {
			ids = append(ids, j%c.layout.numBlocks())
		}
		parent := Key{}
		if n > 0 {
			parent = keys[n-1]
		}
		res, err = c.BeginStore(StoreRequest{Parent: parent, Keys: keys[n:], BlockIDs: ids}, res[:0])
		if err != nil {
			b.Fatal(err)
		}
		slots = slots[:0]
		for _, x := range res {
			if x.Outcome == StoreWrite {
				slots = append(slots, x.Slot)
			}
		}
		if err := c.CompleteStore(slots, nil); err != nil {
			b.Fatal(err)
		}
		c.syncPolicy() // requests are ms apart in serving; let ristretto catch up
	}
	r.st = c.Stats()
	return r
}

// BenchmarkHitRatio compares TinyLFU and LRU, each storing every block or
// only blocks seen twice, on trace.Default at three pool sizes (8B-like
// 2 MiB blocks). One iteration replays the whole trace.
func BenchmarkHitRatio(b *testing.B) {
	const requests = 1500
	layout, err := NewLayout(denseSpec(LayerSeparate, llama3_8B, 4096, 1<<44))
	if err != nil {
		b.Fatal(err)
	}
	for _, slots := range []int{2048, 8192, 32768} {
		for _, pol := range []string{"tinylfu", "lru"} {
			for _, threshold := range []int{1, 2} {
				b.Run(fmt.Sprintf("slots=%d/%s/threshold=%d", slots, pol, threshold), func(b *testing.B) {
					var r replayResult
					for i := 0; i < b.N; i++ {
						var p Policy = newLRU()
						if pol == "tinylfu" {
							if p, err = NewTinyLFU(TinyLFUConfig{MaxBlocks: slots}); err != nil {
								b.Fatal(err)
							}
						}
						c, err := New(Config{Layout: layout, Policy: p, LowWatermark: slots / 64, StoreThreshold: threshold})
						if err != nil {
							b.Fatal(err)
						}
						if _, err := c.AddRegion(Region{ID: 1, Base: 1 << 40, Size: uint64(slots) * layout.SlotSize()}); err != nil {
							b.Fatal(err)
						}
						r = replay(b, c, requests)
						c.Close()
					}
					slot := float64(layout.SlotSize())
					b.ReportMetric(float64(r.hits)/float64(r.blocks), "hit-ratio")
					b.ReportMetric(float64(r.hits)*slot/(1<<30), "GiB-reloaded")
					b.ReportMetric(float64(r.st.StoreAllocated)*slot/(1<<30), "GiB-D2H")
					b.ReportMetric(float64(r.st.WastedD2HBytes)/(1<<30), "GiB-D2H-wasted")
					b.ReportMetric(float64(r.st.Orphaned), "orphans")
				})
			}
		}
	}
}

// BenchmarkControlPlane measures the bookkeeping of the engine's hot path
// at 1M slots (full pool, so every store also evicts): per block, store
// (BeginStore + CompleteStore) then Lookup, in batches of 16 blocks.
// Target: ≤ 1 µs per block for the three together.
func BenchmarkControlPlane(b *testing.B) {
	const slots, batch = 1 << 20, 16
	layout, err := NewLayout(denseSpec(LayerSeparate, llama3_8B, 4096, 1<<44))
	if err != nil {
		b.Fatal(err)
	}
	for _, pol := range []string{"lru", "tinylfu"} {
		var p Policy = newLRU()
		if pol == "tinylfu" {
			if p, err = NewTinyLFU(TinyLFUConfig{MaxBlocks: slots}); err != nil {
				b.Fatal(err)
			}
		}
		c, err := New(Config{Layout: layout, Policy: p, LowWatermark: 1024})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := c.AddRegion(Region{ID: 1, Base: 1 << 40, Size: slots * layout.SlotSize()}); err != nil {
			b.Fatal(err)
		}
		var next atomic.Uint64
		storeBatch := func(keys []Key, ids []int, res []StoreResult, sl []Slot) ([]StoreResult, []Slot) {
			base := next.Add(batch) - batch
			for j := range keys {
				keys[j] = Key{}
				for k := 0; k < 8; k++ {
					keys[j][k] = byte((base + uint64(j)) >> (8 * k))
				}
				keys[j][15] = 1
			}
			res, err := c.BeginStore(StoreRequest{Keys: keys, BlockIDs: ids}, res[:0])
			if err != nil {
				b.Error(err)
				return res, sl
			}
			sl = sl[:0]
			for _, x := range res {
				if x.Outcome == StoreWrite {
					sl = append(sl, x.Slot)
				}
			}
			if err := c.CompleteStore(sl, nil); err != nil {
				b.Error(err)
			}
			c.Lookup(keys)
			return res, sl
		}
		ids := make([]int, batch)
		for j := range ids {
			ids[j] = j
		}
		keys := make([]Key, batch)
		var res []StoreResult
		var sl []Slot
		for i := 0; i < slots/batch; i++ { // fill the pool
			res, sl = storeBatch(keys, ids, res, sl)
		}
		c.syncPolicy()
		b.Run(pol+"/goroutines=1", func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				res, sl = storeBatch(keys, ids, res, sl)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*batch), "ns/block")
		})
		b.Run(pol+"/goroutines=GOMAXPROCS", func(b *testing.B) {
			b.RunParallel(func(pb *testing.PB) {
				keys := make([]Key, batch)
				var res []StoreResult
				var sl []Slot
				for pb.Next() {
					res, sl = storeBatch(keys, ids, res, sl)
				}
			})
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*batch), "ns/block")
		})
		b.Run(pol+"/lookup-hit", func(b *testing.B) {
			hit := make([]Key, batch)
			copy(hit, keys)
			for i := 0; i < b.N; i++ {
				c.Lookup(hit)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*batch), "ns/block")
		})
		// Stores evict ready blocks inline when the watermark is not enough
		// (ristretto's own evictions lag behind a tight loop): none is
		// refused, nothing here is leased.
		st := c.Stats()
		if st.StoreRefusedFull > 0 {
			b.Errorf("%s refused stores: %+v", pol, st)
		}
		b.Logf("%s: %d stores, %d evicted, %d rejected", pol, st.StoreKeys, st.Evicted, st.Rejected)
		c.Close()
	}
}

// BenchmarkBeginLoad2048: BeginLoad and EndLoad of 2048 stored keys into
// random block ids, the index work of one large Load call.
func BenchmarkBeginLoad2048(b *testing.B) { benchBeginLoad2048(b, false) }

// BenchmarkBeginLoad2048Cold is BenchmarkBeginLoad2048 with the CPU's
// caches flushed before each call (64 MiB written, outside the timing), as
// inside an engine, where other work runs between calls: the index work
// of a large Load call when nothing of it is cached. Only BeginLoad is
// timed.
func BenchmarkBeginLoad2048Cold(b *testing.B) { benchBeginLoad2048(b, true) }

func benchBeginLoad2048(b *testing.B, cold bool) {
	const n = 2048
	ids := make([]int, n)
	for j := range ids {
		ids[j] = (j * 7919) % (2 * n)
	}
	c, keys, sl := storedCache(b, LayerSeparate, 2*n, ids, 7)
	var flush []byte
	if cold {
		flush = make([]byte, 64<<20)
	}
	var err error
	var lr []LoadResult
	b.ResetTimer()
	for i := range b.N {
		if cold {
			b.StopTimer()
			for j := 0; j < len(flush); j += 64 {
				flush[j] = byte(i)
			}
			b.StartTimer()
		}
		lr, err = c.BeginLoad(keys, ids, lr[:0])
		if err != nil {
			b.Fatal(err)
		}
		if cold {
			b.StopTimer()
		}
		sl = sl[:0]
		for _, x := range lr {
			sl = append(sl, x.Slot)
		}
		if err := c.EndLoad(sl); err != nil {
			b.Fatal(err)
		}
		if cold {
			b.StartTimer()
		}
	}
}

// BenchmarkLookupLease1024: LookupLease of a 1024-block chain (all hits)
// and the Unlease that gives the leases back, timed apart by hand: the
// index's share of the node pool's lookup round trip (nodepool's
// BenchmarkLookupLease, target ≤ 100 µs for the round trip).
func BenchmarkLookupLease1024(b *testing.B) {
	const n = 1024
	ids := make([]int, n)
	for j := range ids {
		ids[j] = j
	}
	c, keys, sl := storedCache(b, CrossLayer, 4*n, ids, 9)
	var looked, unleased time.Duration
	b.ResetTimer()
	for range b.N {
		t0 := time.Now()
		hits, dst := c.LookupLease(keys, sl[:0])
		t1 := time.Now()
		if hits != n || len(dst) != n {
			b.Fatalf("%d hits, %d leases", hits, len(dst))
		}
		if err := c.Unlease(dst); err != nil {
			b.Fatal(err)
		}
		looked += t1.Sub(t0)
		unleased += time.Since(t1)
		sl = dst
	}
	b.ReportMetric(float64(looked.Nanoseconds())/1e3/float64(b.N), "µs/lookup")
	b.ReportMetric(float64(unleased.Nanoseconds())/1e3/float64(b.N), "µs/unlease")
}

// storedCache returns an LRU cache of slots slots over kind's 8B-class
// layout (closed when b ends) holding len(ids) keys, stored from block ids
// ids (key j's first two bytes are j, its last tag), and their slots.
func storedCache(b *testing.B, kind LayoutKind, slots int, ids []int, tag byte) (*Cache, []Key, []Slot) {
	b.Helper()
	layout, err := NewLayout(denseSpec(kind, llama3_8B, slots, 1<<44))
	if err != nil {
		b.Fatal(err)
	}
	c, err := New(Config{Layout: layout, Policy: newLRU()})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(c.Close)
	if _, err := c.AddRegion(Region{ID: 1, Base: 1 << 40, Size: uint64(slots) * layout.SlotSize()}); err != nil {
		b.Fatal(err)
	}
	keys := make([]Key, len(ids))
	for j := range keys {
		keys[j][0], keys[j][1], keys[j][15] = byte(j), byte(j>>8), tag
	}
	res, err := c.BeginStore(StoreRequest{Keys: keys, BlockIDs: ids}, nil)
	if err != nil {
		b.Fatal(err)
	}
	var sl []Slot
	for _, x := range res {
		sl = append(sl, x.Slot)
	}
	if err := c.CompleteStore(sl, nil); err != nil {
		b.Fatal(err)
	}
	return c, keys, sl
}
