package offload

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// tpModelHeads etc. are a small model: 2 layers, 4 KV heads of 8 bf16
// elements, 4 tokens per block (16-byte rows, 64-byte heads).
const (
	tpLayers, tpModelHeads, tpHeadDim, tpDType, tpTokens = 2, 4, 8, 2, 4
	tpBlocks                                             = 8
)

// tpLayout is rank r of a TP size of tp: its heads of the model, token-major
// (so that a rank of several heads copies 2-D segments), tensors allocated
// by the engine.
func tpLayout(tp, r int) LayoutSpec {
	n := tpModelHeads / tp
	return LayoutSpec{Kind: LayoutLayerSeparate, Layers: tpLayers, KVHeads: n, ModelKVHeads: tpModelHeads, HeadFirst: r * n,
		HeadDim: tpHeadDim, DTypeBytes: tpDType, TokensPerBlock: tpTokens, NumBlocks: tpBlocks, Order: OrderTokenMajor}
}

// tpByte is the model's KV: byte e of (sequence block j, layer, K/V,
// token, head), the same whatever the TP size.
func tpByte(j, layer, kv, tok, head, e int) byte {
	return byte(j*97 + layer*41 + kv*23 + tok*13 + head*7 + e*3 + 1)
}

// tpDevice is sequence block j as the device tensors of layout l hold it
// (one layer's K then V, token-major: [tokens, rank's heads, head bytes]),
// per layer and K/V.
func tpDevice(l LayoutSpec, j int) [][]byte {
	row := l.HeadDim * l.DTypeBytes
	var out [][]byte
	for layer := 0; layer < l.Layers; layer++ {
		for kv := 0; kv < 2; kv++ {
			b := make([]byte, 0, l.TokensPerBlock*l.KVHeads*row)
			for tok := 0; tok < l.TokensPerBlock; tok++ {
				for h := l.HeadFirst; h < l.HeadFirst+l.KVHeads; h++ {
					for e := 0; e < row; e++ {
						b = append(b, tpByte(j, layer, kv, tok, h, e))
					}
				}
			}
			out = append(out, b)
		}
	}
	return out
}

// tpAddr is the device address of block id's layer K (kv 0) or V in l.
func tpAddr(l LayoutSpec, id, layer, kv int) uint64 {
	t := l.LayerTensors[layer]
	base := t.K
	if kv == 1 {
		base = t.V
	}
	return base + uint64(id)*t.Stride
}

func tpWrite(t *testing.T, e *Engine, l LayoutSpec, id, j int) {
	t.Helper()
	for i, b := range tpDevice(l, j) {
		require.NoError(t, e.sim.Write(tpAddr(l, id, i/2, i%2), b))
	}
}

// tpCheck checks that GPU block id of l holds sequence block j, byte-exact.
func tpCheck(t *testing.T, e *Engine, l LayoutSpec, id, j int, what string) {
	t.Helper()
	for i, want := range tpDevice(l, j) {
		got := make([]byte, len(want))
		require.NoError(t, e.sim.Read(tpAddr(l, id, i/2, i%2), got))
		require.True(t, bytes.Equal(want, got), "%s: block %d (sequence block %d) layer %d kv %d", what, id, j, i/2, i%2)
	}
}

// tpPoisoned checks that GPU block id of l is all poison.
func tpPoisoned(t *testing.T, e *Engine, l LayoutSpec, id int, what string) {
	t.Helper()
	n := l.TokensPerBlock * l.KVHeads * l.HeadDim * l.DTypeBytes
	for layer := 0; layer < l.Layers; layer++ {
		for kv := 0; kv < 2; kv++ {
			got := make([]byte, n)
			require.NoError(t, e.sim.Read(tpAddr(l, id, layer, kv), got))
			require.Equal(t, bytes.Repeat([]byte{0xEE}, n), got, "%s: block %d layer %d kv %d written", what, id, layer, kv)
		}
	}
}

func tpPoison(t *testing.T, e *Engine, l LayoutSpec) {
	t.Helper()
	n := uint64(l.NumBlocks * l.TokensPerBlock * l.KVHeads * l.HeadDim * l.DTypeBytes)
	for _, lt := range l.LayerTensors {
		require.NoError(t, e.sim.Fill(lt.K, n, 0xEE))
		require.NoError(t, e.sim.Fill(lt.V, n, 0xEE))
	}
}

// tpRun returns a func that waits for an op and returns its outcomes.
func tpRun(t *testing.T) func(*Op, error) []Outcome {
	return func(op *Op, err error) []Outcome {
		t.Helper()
		require.NoError(t, err)
		require.NoError(t, op.Wait(context.Background()))
		oc, err := op.Outcomes()
		require.NoError(t, err)
		require.NoError(t, op.Release())
		return oc
	}
}

func repeatOutcome(o Outcome, n int) []Outcome {
	out := make([]Outcome, n)
	for i := range out {
		out[i] = o
	}
	return out
}

// TestTPSizeSharing: the two ranks of TP=2 (the engine and a Rank view)
// store their heads of the same blocks into shared slots; the blocks are
// invisible until both stored; then TP=1 and the four ranks of TP=4 (Rank
// views over the same pool) load them, each byte-exact against the same
// KV laid out for its TP size (token-major: 2-D segments for ranks of
// several heads), per layer too, into poisoned blocks of which only the
// loaded ones change. KV events announce each block once.
// It runs twice: with template requests (the simulated device copies
// them: the ranks' head-sliced copies each go as one launch, or one a
// layer) and without (Build's segments in parts).
func TestTPSizeSharing(t *testing.T) {
	for _, noTemplates := range []bool{false, true} {
		t.Run(fmt.Sprint("templates=", !noTemplates), func(t *testing.T) { tpSizeSharing(t, noTemplates) })
	}
}

func tpSizeSharing(t *testing.T, noTemplates bool) {
	e, err := newEngine(Config{Backend: BackendHost, SkipMemoryCheck: true, PoolBytes: 64 * 4096, Layout: tpLayout(2, 0), Namespace: "model-x"},
		engineHooks{noTemplates: noTemplates})
	require.NoError(t, err)
	defer func() { _ = e.Close() }() // closed below; this on a failure
	events := e.Events(256)
	r1, err := e.Rank(tpLayout(2, 1))
	require.NoError(t, err)
	tp2 := []LayoutSpec{e.Config().Layout, r1.layoutSpec()}
	require.Equal(t, 0, tp2[0].HeadFirst)
	require.Equal(t, 2, tp2[1].HeadFirst)

	const n = 3
	var keys []Key
	for j := range n {
		keys = append(keys, testKey(100+j))
	}
	tokens := make([]uint32, n*tpTokens)
	for i := range tokens {
		tokens[i] = uint32(1000 + i)
	}
	ids := [][]int{{3, 5, 0}, {1, 2, 7}} // each rank's GPU blocks of the sequence
	for r, l := range tp2 {
		for j := range n {
			tpWrite(t, e, l, ids[r][j], j)
		}
	}
	oc := tpRun(t)(e.Store(context.Background(), keys, ids[0], StoreOptions{Tokens: tokens}))
	require.Equal(t, repeatOutcome(OutcomeStored, n), oc)
	st := e.Stats()
	require.Equal(t, int64(n), st.Partial)
	require.Equal(t, int64(n*tpLayers*2*2*tpTokens*tpHeadDim*tpDType), st.Copies.Store.Bytes, "rank 0 copied its heads only")
	res, err := e.Lookup(keys, LookupOptions{})
	require.NoError(t, err)
	require.Zero(t, res.Hits, "a block missing rank 1's heads is invisible")
	oc = tpRun(t)(e.Load(context.Background(), keys, ids[0], LoadOptions{}))
	require.Equal(t, repeatOutcome(OutcomeMissing, n), oc, "a block missing rank 1's heads is never loaded")

	oc = tpRun(t)(r1.Store(context.Background(), keys, ids[1], StoreOptions{Tokens: tokens}))
	require.Equal(t, repeatOutcome(OutcomeStored, n), oc, "rank 1's heads are a write into the same slots")
	st = e.Stats()
	require.Equal(t, int64(0), st.Partial)
	require.Equal(t, int64(n), st.StoreJoined)
	require.Equal(t, int64(n), st.Pool.BlocksReady)
	require.Equal(t, int64(2*n), st.Outcomes[OutcomeStored])
	res, err = r1.Lookup(keys, LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, n, res.Hits)
	oc = tpRun(t)(r1.Store(context.Background(), keys, ids[1], StoreOptions{}))
	require.Equal(t, repeatOutcome(OutcomeAlreadyPresent, n), oc, "stored heads are not stored twice")

	// Every TP size loads: TP=1, the TP=2 ranks (per layer), TP=4.
	views := map[string][]*RankView{}
	for _, tp := range []int{1, 4} {
		for r := range tp {
			v, err := e.Rank(tpLayout(tp, r))
			require.NoError(t, err)
			views[fmt.Sprint("TP=", tp)] = append(views[fmt.Sprint("TP=", tp)], v)
		}
	}
	self, err := e.Rank(tpLayout(2, 0)) // another view of rank 0's heads, its own tensors
	require.NoError(t, err)
	views["TP=2"] = []*RankView{self, r1}
	dst := []int{6, 4, 2}
	for name, vs := range views {
		for r, v := range vs {
			l := v.layoutSpec()
			tpPoison(t, e, l)
			oc := tpRun(t)(v.Load(context.Background(), keys, dst, LoadOptions{PerLayer: name == "TP=2"}))
			require.Equal(t, repeatOutcome(OutcomeLoaded, n), oc, "%s rank %d", name, r)
			for j, id := range dst {
				tpCheck(t, e, l, id, j, fmt.Sprintf("%s rank %d", name, r))
			}
			for id := range tpBlocks {
				if id != 6 && id != 4 && id != 2 {
					tpPoisoned(t, e, l, id, fmt.Sprintf("%s rank %d", name, r))
				}
			}
		}
	}
	if noTemplates {
		require.Zero(t, e.sim.Templated())
	} else {
		// Two stores, TP=1's load (all four heads, token-major: 2-D
		// pieces), TP=2's two per-layer loads of tpLayers parts each; not
		// TP=4's (a rank of one head copies contiguous segments).
		require.EqualValues(t, 2+1+2*tpLayers, e.sim.Templated(), "template copies")
	}
	require.NoError(t, e.Close())
	var stored []Event
	for ev := range events.C {
		if ev.Kind == EventStored {
			stored = append(stored, ev)
		}
	}
	require.Len(t, stored, n, "one EventStored per block, when its last rank stored")
	for j, ev := range stored {
		require.Equal(t, keys[j], ev.Key)
		require.Equal(t, tokens[j*tpTokens:(j+1)*tpTokens], ev.Tokens)
	}
	_, err = r1.Store(context.Background(), keys, ids[1], StoreOptions{})
	require.ErrorIs(t, err, ErrClosed)
}

// TestTPRankDeath: a block one rank of TP=2 stored and the other never did
// is never loaded, and Config.PartialTimeout reclaims it from the engine's
// idle path (no store needed); stored again by both ranks it loads.
func TestTPRankDeath(t *testing.T) {
	e := newTestEngine(t, Config{PoolBytes: 64 * 4096, Layout: tpLayout(2, 0), PartialTimeout: 100 * time.Millisecond})
	defer func() { require.NoError(t, e.Close()) }()
	r1, err := e.Rank(tpLayout(2, 1))
	require.NoError(t, err)
	keys := []Key{testKey(7), testKey(8)}
	tpWrite(t, e, e.Config().Layout, 0, 0)
	tpWrite(t, e, e.Config().Layout, 1, 1)
	tpWrite(t, e, r1.layoutSpec(), 0, 0)
	tpWrite(t, e, r1.layoutSpec(), 1, 1)
	oc := tpRun(t)(e.Store(context.Background(), keys, []int{0, 1}, StoreOptions{}))
	require.Equal(t, repeatOutcome(OutcomeStored, 2), oc)
	require.Equal(t, int64(2), e.Stats().Partial)
	free := e.Stats().Pool.SlotsFree
	oc = tpRun(t)(r1.Load(context.Background(), keys, []int{2, 3}, LoadOptions{}))
	require.Equal(t, repeatOutcome(OutcomeMissing, 2), oc)
	require.Eventually(t, func() bool {
		st := e.Stats()
		return st.PartialExpired == 2 && st.Partial == 0 && st.Pool.SlotsFree == free+2
	}, 10*time.Second, 10*time.Millisecond, "the reaper reclaims the partial blocks")
	// Rank 1 alone now starts new partial blocks: still nothing to load.
	oc = tpRun(t)(r1.Store(context.Background(), keys, []int{0, 1}, StoreOptions{}))
	require.Equal(t, repeatOutcome(OutcomeStored, 2), oc)
	oc = tpRun(t)(e.Store(context.Background(), keys, []int{0, 1}, StoreOptions{}))
	require.Equal(t, repeatOutcome(OutcomeStored, 2), oc)
	v, err := e.Rank(tpLayout(1, 0))
	require.NoError(t, err)
	tpPoison(t, e, v.layoutSpec())
	oc = tpRun(t)(v.Load(context.Background(), keys, []int{4, 5}, LoadOptions{}))
	require.Equal(t, repeatOutcome(OutcomeLoaded, 2), oc)
	tpCheck(t, e, v.layoutSpec(), 4, 0, "TP=1")
	tpCheck(t, e, v.layoutSpec(), 5, 1, "TP=1")
}

// TestRankErrors: a view must describe the same model, blocks and slot
// format; errors name the field, the value and the engine's.
func TestRankErrors(t *testing.T) {
	e := newTestEngine(t, Config{PoolBytes: 64 * 4096, Layout: tpLayout(2, 0)})
	defer func() { require.NoError(t, e.Close()) }()
	mod := func(f func(*LayoutSpec)) LayoutSpec { l := tpLayout(2, 1); f(&l); return l }
	for _, tc := range []struct {
		name string
		l    LayoutSpec
		want string
	}{
		{"blocks", mod(func(l *LayoutSpec) { l.NumBlocks = 9 }), "NumBlocks = 9, the engine's is 8"},
		{"model heads", mod(func(l *LayoutSpec) { l.ModelKVHeads = 8 }), "the engine's is 4"},
		{"undeclared order", mod(func(l *LayoutSpec) { l.Order = "" }), "declared order"},
		{"range past the model", mod(func(l *LayoutSpec) { l.HeadFirst = 3 }), "heads [3, 5)"},
		{"bad order", mod(func(l *LayoutSpec) { l.Order = "sideways" }), "sideways"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := e.Rank(tc.l)
			require.ErrorIs(t, err, ErrInvalidConfig)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

// TestLayoutHeadsConfig: the head fields are checked with errors naming
// the value and the limit, and the record fingerprint names the model's
// heads and the host format, never the rank or the TP size.
func TestLayoutHeadsConfig(t *testing.T) {
	mod := func(f func(*LayoutSpec)) Config {
		l := tpLayout(2, 1)
		f(&l)
		return Config{PoolBytes: 1 << 20, Layout: l}
	}
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"negative model heads", mod(func(l *LayoutSpec) { l.ModelKVHeads = -1 }), "ModelKVHeads = -1"},
		{"negative first", mod(func(l *LayoutSpec) { l.HeadFirst = -2 }), "HeadFirst = -2"},
		{"first without the model", mod(func(l *LayoutSpec) { l.ModelKVHeads = 0 }), "HeadFirst = 2 without ModelKVHeads"},
		{"past the model", mod(func(l *LayoutSpec) { l.HeadFirst = 3 }), "heads [3, 5) (HeadFirst 3, KVHeads 2) outside the model's ModelKVHeads = 4 heads [0, 4)"},
		{"more than the model", mod(func(l *LayoutSpec) { l.KVHeads, l.HeadFirst = 5, 0 }), "ModelKVHeads = 4"},
		{"range without order", mod(func(l *LayoutSpec) { l.Order = "" }), "KVHeads = 2 of ModelKVHeads = 4: a rank holding part of the model's heads needs Order"},
		{"unknown order", mod(func(l *LayoutSpec) { l.Order = "diagonal" }), `Layout.Order "diagonal"`},
		{"negative partial timeout", Config{PoolBytes: 1 << 20, Layout: tpLayout(2, 0), PartialTimeout: -time.Second}, "PartialTimeout = -1s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, _, err := withDefaults(tc.cfg)
			require.ErrorIs(t, err, ErrInvalidConfig)
			require.ErrorContains(t, err, tc.want)
		})
	}
	cfg, _, slot, err := withDefaults(Config{PoolBytes: 1 << 20, Layout: tpLayout(4, 3)})
	require.NoError(t, err)
	require.Equal(t, int64(tpLayers*2*tpModelHeads*tpTokens*tpHeadDim*tpDType), slot, "a slot holds every head of the model")
	require.Equal(t, 30*time.Second, cfg.PartialTimeout)

	fp := func(l LayoutSpec) uint64 {
		f, err := recordFingerprint(Config{Namespace: "m", Layout: l})
		require.NoError(t, err)
		return f
	}
	shared := fp(tpLayout(1, 0))
	for _, l := range []LayoutSpec{tpLayout(2, 0), tpLayout(2, 1), tpLayout(4, 3)} {
		require.Equal(t, shared, fp(l), "rank %d of %d heads", l.HeadFirst, l.KVHeads)
	}
	hm := tpLayout(2, 1)
	hm.Order = OrderHeadMajor
	require.Equal(t, shared, fp(hm), "the device order is not the host format")
	whole := tpLayout(1, 0)
	whole.Order, whole.ModelKVHeads = "", 0
	require.NotEqual(t, shared, fp(whole), "a device-order slot is another format")
}

// TestTPConcurrentRanks: the four ranks of TP=4 store the same blocks at
// once, each from its own goroutine and in its own order, while a TP=1
// view loads them; every block it finds is whole (byte-exact), and in the
// end every block is stored once with three joins. Run under -race.
func TestTPConcurrentRanks(t *testing.T) {
	e := newTestEngine(t, Config{PoolBytes: 64 * 4096, Layout: tpLayout(4, 0)})
	defer func() { require.NoError(t, e.Close()) }()
	ranks := []*RankView{nil}
	for r := 1; r < 4; r++ {
		v, err := e.Rank(tpLayout(4, r))
		require.NoError(t, err)
		ranks = append(ranks, v)
	}
	layout := func(r int) LayoutSpec {
		if r == 0 {
			return e.Config().Layout
		}
		return ranks[r].layoutSpec()
	}
	const n = tpBlocks
	keys := make([]Key, n)
	for j := range keys {
		keys[j] = testKey(500 + j)
	}
	for r := range 4 {
		for j := range n {
			tpWrite(t, e, layout(r), j, j)
		}
	}
	reader, err := e.Rank(tpLayout(1, 0))
	require.NoError(t, err)
	done := make(chan struct{})
	errs := make(chan error, 8)
	go func() {
		defer close(done)
		for i := 0; i < 50; i++ {
			for _, lt := range reader.layoutSpec().LayerTensors { // tpPoison, off the test's goroutine
				_ = e.sim.Fill(lt.K, uint64(tpBlocks*tpTokens*tpModelHeads*tpHeadDim*tpDType), 0xEE)
				_ = e.sim.Fill(lt.V, uint64(tpBlocks*tpTokens*tpModelHeads*tpHeadDim*tpDType), 0xEE)
			}
			op, err := reader.Load(context.Background(), keys[:1], []int{0}, LoadOptions{})
			if err == nil {
				err = op.Wait(context.Background())
			}
			if err != nil {
				errs <- err
				return
			}
			if op.count(OutcomeLoaded) == 1 {
				got := make([]byte, tpTokens*tpModelHeads*tpHeadDim*tpDType)
				_ = e.sim.Read(tpAddr(reader.layoutSpec(), 0, 1, 1), got)
				if !bytes.Equal(got, tpDevice(reader.layoutSpec(), 0)[3]) {
					errs <- fmt.Errorf("load %d: a visible block was not whole", i)
				}
			}
			_ = op.Release()
		}
	}()
	stored := make(chan int, 4)
	for r := range 4 {
		go func() {
			ks := make([]Key, n)
			ids := make([]int, n)
			for j := range n {
				k := (j + r*3) % n // each rank its own order
				ks[j], ids[j] = keys[k], k
			}
			var op *Op
			var err error
			if r == 0 {
				op, err = e.Store(context.Background(), ks, ids, StoreOptions{Parents: make([]Key, n)})
			} else {
				op, err = ranks[r].Store(context.Background(), ks, ids, StoreOptions{Parents: make([]Key, n)})
			}
			if err == nil {
				err = op.Wait(context.Background())
			}
			if err != nil {
				errs <- err
				stored <- 0
				return
			}
			stored <- op.count(OutcomeStored)
			_ = op.Release()
		}()
	}
	total := 0
	for range 4 {
		total += <-stored
	}
	<-done
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, 4*n, total, "every rank's heads of every block are a write")
	st := e.Stats()
	require.Equal(t, int64(3*n), st.StoreJoined)
	require.Equal(t, int64(n), st.Pool.BlocksReady)
	require.Zero(t, st.Partial)
	tpPoison(t, e, reader.layoutSpec())
	oc := tpRun(t)(reader.Load(context.Background(), keys, func() []int {
		ids := make([]int, n)
		for j := range ids {
			ids[j] = j
		}
		return ids
	}(), LoadOptions{}))
	require.Equal(t, repeatOutcome(OutcomeLoaded, n), oc)
	for j := range n {
		tpCheck(t, e, reader.layoutSpec(), j, j, "TP=1 after concurrent ranks")
	}
}

// partStarts covers every block once, in order, the first parts smaller.
func TestPartStarts(t *testing.T) {
	require.Equal(t, []int{0}, partStarts(0, 64, 5))
	require.Equal(t, []int{0, 1}, partStarts(1, 64, 5))
	require.Equal(t, []int{0, 2, 6, 14, 30, 62, 126, 190, 200}, partStarts(200, 64, 5))
	require.Equal(t, []int{0, 1, 2, 3, 4, 5}, partStarts(5, 1, 5))
	require.Equal(t, []int{0, 1, 2, 3, 4, 5, 7}, partStarts(7, 2, 5))
	require.Equal(t, []int{0, 8, 24, 56, 120, 128}, partStarts(128, 64, 3))
	require.Equal(t, []int{0, 64, 128}, partStarts(128, 64, 0))
	for n := range 300 {
		for _, per := range []int{1, 2, 3, 8, 64, 500} {
			s := partStarts(n, per, n%9)
			require.Equal(t, 0, s[0])
			require.Equal(t, n, s[len(s)-1])
			for i := 1; i < len(s); i++ {
				require.Greater(t, s[i], s[i-1])
				require.LessOrEqual(t, s[i]-s[i-1], per)
			}
		}
	}
}
