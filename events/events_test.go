package events_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvoffload/kvoffload/events"
	"github.com/kvoffload/kvoffload/offload"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
)

// TestEncodingIsMsgspecArrayLike pins the bytes of one batch to what
// msgspec writes for vLLM's array_like, tagged structs.
func TestEncodingIsMsgspecArrayLike(t *testing.T) {
	var key offload.Key
	for i := range key {
		key[i] = byte(i)
	}
	ts := time.Unix(1700000000, 500_000_000)
	got, err := events.AppendBatch(nil, ts, []offload.Event{
		{Kind: offload.EventRemoved, Key: key, Medium: "CPU"},
		{Kind: offload.EventStored, Key: key, Tokens: []uint32{1, 300}, BlockSize: 2, Medium: "CPU"},
		{Kind: offload.EventCleared},
	})
	require.NoError(t, err)
	var want []byte
	want = append(want, 0x92, 0xcb)
	want = binary.BigEndian.AppendUint64(want, math.Float64bits(1700000000.5))
	want = append(want, 0x93)
	want = append(want, 0x93, 0xac)
	want = append(want, "BlockRemoved"...)
	want = append(want, 0x91, 0xc4, 0x10)
	want = append(want, key[:]...)
	want = append(want, 0xa3, 'C', 'P', 'U')
	want = append(want, 0x97, 0xab)
	want = append(want, "BlockStored"...)
	want = append(want, 0x91, 0xc4, 0x10)
	want = append(want, key[:]...)
	want = append(want, 0xc0)                         // parent_block_hash: None
	want = append(want, 0x92, 0x01, 0xcd, 0x01, 0x2c) // token_ids [1, 300]
	want = append(want, 0x02, 0xc0)                   // block_size, lora_id None
	want = append(want, 0xa3, 'C', 'P', 'U')
	want = append(want, 0x91, 0xb0)
	want = append(want, "AllBlocksCleared"...)
	require.Equal(t, want, got)
}

type message struct {
	seq     uint64
	payload []byte
}

// decoded is one event as a subscriber decodes it.
func decodeBatch(t *testing.T, payload []byte) []offload.Event {
	t.Helper()
	dec := msgpack.NewDecoder(bytes.NewReader(payload))
	dec.UseLooseInterfaceDecoding(true)
	v, err := dec.DecodeInterface()
	require.NoError(t, err)
	batch := v.([]any)
	require.Len(t, batch, 2)
	_, ok := batch[0].(float64)
	require.True(t, ok, "ts is a float")
	var out []offload.Event
	for _, x := range batch[1].([]any) {
		f := x.([]any)
		var ev offload.Event
		hash := func(v any) (k offload.Key) {
			var b []byte
			switch x := v.(type) { // the decoder gives bin as []byte or string
			case []byte:
				b = x
			case string:
				b = []byte(x)
			}
			require.Len(t, b, 16)
			copy(k[:], b)
			return k
		}
		switch f[0].(string) {
		case "BlockStored":
			require.Len(t, f, 7)
			hs := f[1].([]any)
			require.Len(t, hs, 1)
			ev = offload.Event{Kind: offload.EventStored, Key: hash(hs[0]), BlockSize: int(f[4].(int64)), Medium: f[6].(string)}
			if f[2] != nil {
				ev.Parent = hash(f[2])
			}
			for _, tok := range f[3].([]any) {
				switch n := tok.(type) {
				case uint64:
					ev.Tokens = append(ev.Tokens, uint32(n))
				case int64:
					ev.Tokens = append(ev.Tokens, uint32(n))
				}
			}
			require.Nil(t, f[5], "lora_id")
		case "BlockRemoved":
			require.Len(t, f, 3)
			hs := f[1].([]any)
			require.Len(t, hs, 1)
			ev = offload.Event{Kind: offload.EventRemoved, Key: hash(hs[0]), Medium: f[2].(string)}
		case "AllBlocksCleared":
			require.Len(t, f, 1)
			ev = offload.Event{Kind: offload.EventCleared}
		default:
			t.Fatalf("unknown tag %v", f[0])
		}
		out = append(out, ev)
	}
	return out
}

// TestPublishOverZeroMQ runs an engine's ops with a Publisher on a PUB
// socket and a SUB socket in the test, decodes every batch and checks the
// events against an in-process stream of the same engine and against
// Stats: none lost (the sequence numbers have no gap, the engine dropped
// none), in order, ending with AllBlocksCleared when the engine closes.
func TestPublishOverZeroMQ(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e, err := offload.New(offload.Config{PoolBytes: 4 * 8192, Backend: offload.BackendHost, SkipMemoryCheck: true,
		Layout: offload.LayoutSpec{Kind: offload.LayoutLayerSeparate, Layers: 2, KVHeads: 1, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: 16}})
	require.NoError(t, err)
	ref := e.Events(1 << 16)
	stream := e.Events(1 << 16)
	pub, err := events.Listen(ctx, "tcp://127.0.0.1:0", events.Options{Topic: "kv"})
	require.NoError(t, err)
	defer pub.Close()
	runDone := make(chan error, 1)
	go func() { runDone <- pub.Run(ctx, stream) }()

	sub := zmq4.NewSub(ctx)
	defer sub.Close()
	require.NoError(t, sub.Dial("tcp://"+pub.Addr().String()))
	require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, "kv"))
	msgs := make(chan message, 1024)
	go func() {
		for {
			m, err := sub.Recv()
			if err != nil {
				close(msgs)
				return
			}
			if len(m.Frames) != 3 || string(m.Frames[0]) != "kv" || len(m.Frames[1]) != 8 {
				t.Errorf("frames: %q", m.Frames)
				continue
			}
			msgs <- message{seq: binary.BigEndian.Uint64(m.Frames[1]), payload: m.Frames[2]}
		}
	}()

	// A PUB socket drops what it sends before the subscription arrives:
	// store and delete a sentinel block until the subscriber hears it.
	// Three sequences of 4 blocks (separate chains: a chain's ancestors
	// are never evicted for its own continuation) and a sentinel.
	var keys []offload.Key
	var tokens []uint32
	for c := range 3 {
		toks := make([]uint32, 16*4)
		for i := range toks {
			toks[i] = uint32(1000*c + i)
		}
		keys, tokens = append(keys, e.Keys(toks)...), append(tokens, toks...)
	}
	sentinel := e.Keys(make([]uint32, 16))
	store := func(ks []offload.Key, toks []uint32, parent offload.Key) {
		op, err := e.Store(ctx, ks, []int{0, 1, 2, 3}[:len(ks)], offload.StoreOptions{Tokens: toks, Parent: parent})
		require.NoError(t, err)
		require.NoError(t, op.Wait(ctx))
		require.NoError(t, op.Release())
	}
	var got []offload.Event
	var next uint64
	first := true
	for heard := false; !heard; {
		store(sentinel, make([]uint32, 16), offload.Key{})
		_, err := e.Delete(sentinel)
		require.NoError(t, err)
		select {
		case m := <-msgs:
			heard, first, next = true, false, m.seq+1
			got = append(got, decodeBatch(t, m.payload)...)
		case <-time.After(100 * time.Millisecond):
		}
	}
	require.False(t, first)
	ws := e.Stats()
	warm := ws.Outcome(offload.OutcomeStored)

	// The ops checked: three chains of 4 blocks into a pool of 4 (the
	// policy evicts), a load, a delete, then Close.
	for i := 0; i < 12; i += 4 {
		store(keys[i:i+4], tokens[i*16:(i+4)*16], offload.Key{})
	}
	op, err := e.Load(ctx, keys[8:12], []int{4, 5, 6, 7}, offload.LoadOptions{})
	require.NoError(t, err)
	require.NoError(t, op.Wait(ctx))
	require.NoError(t, op.Release())
	_, err = e.Delete(keys[10:11])
	require.NoError(t, err)
	st := e.Stats()
	require.NoError(t, e.Close())
	require.NoError(t, <-runDone)

	for len(got) == 0 || got[len(got)-1].Kind != offload.EventCleared {
		select {
		case m, ok := <-msgs:
			require.True(t, ok)
			require.Equal(t, next, m.seq, "no batch lost")
			next++
			got = append(got, decodeBatch(t, m.payload)...)
		case <-time.After(10 * time.Second):
			t.Fatal("no AllBlocksCleared")
		}
	}
	var want []offload.Event
	for ev := range ref.C {
		if ev.Kind == offload.EventCleared {
			ev.BlockSize, ev.Medium = 0, "" // AllBlocksCleared carries neither
		}
		if ev.Kind == offload.EventRemoved {
			ev.BlockSize = 0 // BlockRemoved carries no block size
		}
		want = append(want, ev)
	}
	require.Zero(t, stream.Dropped())
	require.Zero(t, ref.Dropped())
	require.GreaterOrEqual(t, len(want), len(got))
	require.Equal(t, want[len(want)-len(got):], got, "the subscriber got the engine's events, in order, from its first on")
	require.Equal(t, pub.Sent(), int64(len(want)))

	var stored, removed int64
	for _, ev := range want {
		switch ev.Kind {
		case offload.EventStored:
			stored++
		case offload.EventRemoved:
			removed++
		}
	}
	require.Equal(t, st.Outcome(offload.OutcomeStored), stored)
	require.Equal(t, st.Evictions+st.Deletes, removed)
	require.Positive(t, st.Evictions)
	// The checked ops' stored events carry their parents and tokens.
	n := 0
	for _, ev := range got {
		if ev.Kind == offload.EventStored && ev.Key == keys[5] {
			n++
			require.Equal(t, keys[4], ev.Parent)
			require.Equal(t, tokens[5*16:6*16], ev.Tokens)
			require.Equal(t, 16, ev.BlockSize)
			require.Equal(t, offload.MediumCPU, ev.Medium)
		}
	}
	require.Positive(t, n)
	require.GreaterOrEqual(t, st.Outcome(offload.OutcomeStored)-warm, int64(12-4), "the checked stores stored")
	cancel()
	if err := sub.Close(); err != nil && !errors.Is(err, context.Canceled) {
		t.Log(err)
	}
}

// TestDiskMediumEncoded: disk tier events go out with medium "DISK".
func TestDiskMediumEncoded(t *testing.T) {
	var key offload.Key
	key[0] = 7
	evs := []offload.Event{
		{Kind: offload.EventStored, Key: key, BlockSize: 16, Medium: offload.MediumDisk},
		{Kind: offload.EventRemoved, Key: key, Medium: offload.MediumDisk},
	}
	b, err := events.AppendBatch(nil, time.Now(), evs)
	require.NoError(t, err)
	got := decodeBatch(t, b)
	require.Equal(t, evs, got)
	require.Equal(t, "DISK", got[0].Medium)
}

// TestSharedStorageMediumEncoded: the cluster tier's events (a block the
// cluster stored for a write-through) go out with medium "SHARED_STORAGE",
// the name llm-d's storage connectors give a tier shared by engines; a
// block promoted from the cluster is a "CPU" event like any host block.
func TestSharedStorageMediumEncoded(t *testing.T) {
	var key offload.Key
	key[0] = 9
	evs := []offload.Event{
		{Kind: offload.EventStored, Key: key, BlockSize: 16, Medium: offload.MediumSharedStorage},
		{Kind: offload.EventStored, Key: key, BlockSize: 16, Medium: offload.MediumCPU},
	}
	b, err := events.AppendBatch(nil, time.Now(), evs)
	require.NoError(t, err)
	got := decodeBatch(t, b)
	require.Equal(t, evs, got)
	require.Equal(t, "SHARED_STORAGE", got[0].Medium)
}
