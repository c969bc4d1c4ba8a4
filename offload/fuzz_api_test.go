package offload

import (
	"context"
	"errors"
	"testing"
)

// FuzzTrim trims arbitrary amounts (negative, zero, huge) between stores:
// Trim never fails, frees whole regions newest first (freed + pending is
// zero for bytes ≤ 0, else at least min(bytes, owned before)), owned bytes
// drop by exactly what was freed or is pending, and the engine keeps
// answering stores and loads with one outcome per block.
func FuzzTrim(f *testing.F) {
	f.Add(int64(1), int64(0), int64(-5))
	f.Add(int64(64<<10), int64(1<<62), int64(8<<10))
	f.Add(int64(-1<<63), int64(1<<63-1), int64(3))
	f.Fuzz(func(t *testing.T, a, b, c int64) {
		e, err := newEngine(Config{PoolBytes: 256 << 10, FirstRegionBytes: 64 << 10, RegionBytes: 64 << 10, Layout: smallLayout(8),
			Policy: PolicyLRU, Backend: BackendHost, SkipMemoryCheck: true, StagingBytes: -1}, engineHooks{})
		if err != nil {
			t.Fatal(err)
		}
		defer func() {
			if err := e.Close(); err != nil {
				t.Fatal(err)
			}
		}()
		if err := e.WaitGrown(context.Background()); err != nil {
			t.Fatal(err)
		}
		for i, n := range []int64{a, b, c} {
			op, err := e.Store(context.Background(), []Key{testKey(i)}, []int{i}, StoreOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if err := op.Wait(context.Background()); err != nil {
				t.Fatal(err)
			}
			before := e.Stats().Pool.OwnedBytes
			res, err := e.Trim(context.Background(), n)
			if err != nil {
				t.Fatalf("Trim(%d): %v", n, err)
			}
			got := res.FreedBytes + res.PendingBytes
			after := e.Stats().Pool.OwnedBytes
			switch {
			case res.RequestedBytes != n:
				t.Fatalf("Trim(%d) reports %d requested", n, res.RequestedBytes)
			case n <= 0 && (got != 0 || res.Regions != 0):
				t.Fatalf("Trim(%d) freed %d bytes in %d regions", n, got, res.Regions)
			case n > 0 && got < min(n, before):
				t.Fatalf("Trim(%d) with %d owned freed only %d", n, before, got)
			case before-after != got:
				t.Fatalf("Trim(%d): owned %d → %d, but %d freed or pending", n, before, after, got)
			}
			lop, err := e.Load(context.Background(), []Key{testKey(i)}, []int{7}, LoadOptions{})
			if err != nil {
				t.Fatal(err)
			}
			<-lop.Done()
			out, err := lop.Outcomes()
			if err != nil || (out[0] != OutcomeLoaded && out[0] != OutcomeMissing) {
				t.Fatalf("load after Trim(%d): %v %v", n, out, err)
			}
		}
	})
}

// FuzzStaging asks for staging buffers of arbitrary names and sizes: a bad
// size is ErrInvalidArgument, too much is ErrInsufficientMemory, otherwise
// the buffer has exactly the size asked for, lies inside the staging
// region, and asking again for the same name returns it (same size) or
// refuses (another size).
func FuzzStaging(f *testing.F) {
	f.Add("out", int64(100), int64(100))
	f.Add("", int64(0), int64(-1))
	f.Add("big", int64(1<<40), int64(16<<10))
	f.Add("x", int64(16<<10), int64(1))
	e, err := newEngine(Config{PoolBytes: 64 << 10, StagingBytes: 16 << 10, Layout: smallLayout(8), Backend: BackendHost,
		SkipMemoryCheck: true}, engineHooks{})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = e.Close() })
	f.Fuzz(func(t *testing.T, name string, size, again int64) {
		s, err := e.Staging(name, size)
		if err != nil {
			if !errors.Is(err, ErrInvalidArgument) && !errors.Is(err, ErrInsufficientMemory) {
				t.Fatalf("Staging(%q, %d): %v wraps neither sentinel", name, size, err)
			}
			if size > 0 && size <= 16<<10 && errors.Is(err, ErrInvalidArgument) {
				if prev, err2 := e.Staging(name, size); err2 == nil || prev != nil {
					t.Fatalf("Staging(%q, %d) refused as invalid, then %v %v", name, size, prev, err2)
				}
			}
			return
		}
		lo, hi := e.stage.region.r.Addr(), e.stage.region.r.Addr()+uintptr(e.stage.region.r.Len())
		if s.length() != size || int64(len(s.Bytes())) != size || s.Addr() < lo || s.Addr()+uintptr(size) > hi {
			t.Fatalf("Staging(%q, %d) = %d bytes at %#x, region [%#x,%#x)", name, size, s.length(), s.Addr(), lo, hi)
		}
		s2, err := e.Staging(name, again)
		switch {
		case again == size && (err != nil || s2 != s):
			t.Fatalf("Staging(%q, %d) again: %v %v", name, size, s2, err)
		case again != size && (err == nil || !errors.Is(err, ErrInvalidArgument)):
			t.Fatalf("Staging(%q, %d) after %d: %v", name, again, size, err)
		}
	})
}

// FuzzLayoutSpec feeds layer-separate and MLA layouts with per-layer
// tensors through Config validation: either a clear ErrInvalidConfig, or a
// layout that converts to kvcache's spec and back unchanged, whose slot
// size is the sum of its segments.
func FuzzLayoutSpec(f *testing.F) {
	f.Add(uint8(0), 2, 1, 64, 2, 16, 8, uint64(1<<20), uint64(2<<20), uint64(2048))
	f.Add(uint8(2), 1, 1, 512, 2, 16, 4, uint64(1<<30), uint64(0), uint64(16384))
	f.Add(uint8(0), 2, 1, 64, 2, 16, 8, uint64(1<<20), uint64(1<<20), uint64(2048))
	f.Add(uint8(1), 0, -1, 0, 3, 0, -8, uint64(0), uint64(1), uint64(0))
	f.Fuzz(func(t *testing.T, kind uint8, layers, heads, dim, dt, tpb, blocks int, k, v, stride uint64) {
		kinds := []LayoutKind{LayoutLayerSeparate, LayoutMLA, LayoutCrossLayer, "bogus"}
		l := LayoutSpec{Kind: kinds[int(kind)%len(kinds)], Layers: layers, KVHeads: heads, HeadDim: dim, DTypeBytes: dt,
			TokensPerBlock: tpb, NumBlocks: blocks}
		for i := 0; i < min(max(layers, 0), 4); i++ {
			vi := v
			if v != 0 {
				vi = v + uint64(i)<<24
			}
			l.LayerTensors = append(l.LayerTensors, LayerTensors{K: k + uint64(i)<<24, V: vi, Stride: stride})
		}
		_, _, slot, err := withDefaults(Config{PoolBytes: 1 << 30, Layout: l, Backend: BackendHost})
		if err != nil {
			if !errors.Is(err, ErrInvalidConfig) && !errors.Is(err, ErrPoolTooSmall) {
				t.Fatalf("layout %+v: %v wraps no sentinel", l, err)
			}
			return
		}
		spec, err := kvLayoutSpec(l)
		if err != nil {
			t.Fatal(err)
		}
		if back := fromKVLayoutSpec(spec); back.Kind != l.Kind || len(back.LayerTensors) != len(l.LayerTensors) {
			t.Fatalf("round trip %+v → %+v", l, back)
		}
		if slot <= 0 {
			t.Fatalf("layout %+v accepted with slot size %d", l, slot)
		}
	})
}
