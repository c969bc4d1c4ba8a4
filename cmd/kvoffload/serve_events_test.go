package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvoffload/kvoffload/internal/nodepool"
	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
)

// nodeEvent is one event of a node's KVEventBatch as a vLLM subscriber
// decodes it: the tag, the block hash, the medium.
type nodeEvent struct {
	tag    string
	key    kvcache.Key
	medium string
}

// decodeNodeBatch decodes a KVEventBatch payload, checking the array
// form vLLM's msgspec encoder writes ([ts, [event...]], BlockStored of 7
// fields without parent, tokens or lora, BlockRemoved of 3).
func decodeNodeBatch(t *testing.T, payload []byte) []nodeEvent {
	t.Helper()
	dec := msgpack.NewDecoder(bytes.NewReader(payload))
	dec.UseLooseInterfaceDecoding(true)
	v, err := dec.DecodeInterface()
	require.NoError(t, err)
	batch := v.([]any)
	require.Len(t, batch, 2)
	_, ok := batch[0].(float64)
	require.True(t, ok, "ts is a float")
	var out []nodeEvent
	for _, x := range batch[1].([]any) {
		f := x.([]any)
		ev := nodeEvent{tag: f[0].(string)}
		hash := func(v any) {
			hs := v.([]any)
			require.Len(t, hs, 1)
			var b []byte
			switch h := hs[0].(type) {
			case []byte:
				b = h
			case string:
				b = []byte(h)
			}
			require.Len(t, b, 16)
			copy(ev.key[:], b)
		}
		switch ev.tag {
		case "BlockStored":
			require.Len(t, f, 7)
			hash(f[1])
			require.Nil(t, f[2], "parent: the node knows none")
			require.Empty(t, f[3], "tokens: the node knows none")
			require.Nil(t, f[5], "lora_id")
			ev.medium = f[6].(string)
		case "BlockRemoved":
			require.Len(t, f, 3)
			hash(f[1])
			ev.medium = f[2].(string)
		default:
			t.Fatalf("unexpected tag %v", f[0])
		}
		out = append(out, ev)
	}
	return out
}

// TestServeEvents: `serve --events` publishes the node's KV events on a
// ZeroMQ PUB socket as vLLM's KVEventBatches: frames [topic "", seq, payload],
// seq counting up by one from message to message, the blocks stored and
// removed through the node as BlockStored and BlockRemoved of medium CPU.
func TestServeEvents(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "node.sock")
	cmd, stdout := startServeCmd(t, sock, "--pool", "4MiB", "--events", "tcp://127.0.0.1:0")
	// The banner comes after the listening line: wait for it.
	const banner = "publishing KV events at "
	var endpoint string
	require.Eventually(t, func() bool {
		out := stdout.String()
		i := strings.Index(out, banner)
		if i < 0 || !strings.Contains(out[i:], "\n") {
			return false
		}
		endpoint = strings.Fields(out[i+len(banner):])[0]
		return true
	}, 20*time.Second, 10*time.Millisecond, "stdout %q", stdout)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sub := zmq4.NewSub(ctx)
	defer sub.Close()
	require.NoError(t, sub.Dial(endpoint))
	require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, ""))
	type message struct {
		seq uint64
		evs []nodeEvent
	}
	msgs := make(chan message, 1024)
	go func() {
		defer close(msgs)
		for {
			m, err := sub.Recv()
			if err != nil {
				return
			}
			if len(m.Frames) != 3 || len(m.Frames[0]) != 0 || len(m.Frames[1]) != 8 {
				t.Errorf("frames: %q", m.Frames)
				continue
			}
			msgs <- message{seq: binary.BigEndian.Uint64(m.Frames[1]), evs: decodeNodeBatch(t, m.Frames[2])}
		}
	}()

	layout := nodepool.LayoutOf(kvcache.CrossLayer, kvcache.Geometry{Layers: 2, KVHeads: 2, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16})
	c, err := nodepool.Dial(sock, nodepool.ClientConfig{Namespace: "m", Layout: layout, Redial: -1, PrefaultThreads: 1})
	require.NoError(t, err)
	defer c.Close()
	store := func(keys ...kvcache.Key) {
		res, err := c.BeginStore(nodepool.StoreRequest{Keys: keys}, nil)
		require.NoError(t, err)
		slots := make([]nodepool.Slot, len(res))
		for i, r := range res {
			slots[i] = r.Slot
		}
		require.NoError(t, c.CommitStore(slots))
	}
	// A PUB socket drops what it sends before the subscription arrives:
	// store and delete a sentinel until the subscriber hears it.
	sentinel := kvcache.Key{0xee}
	var last uint64
	for heard := false; !heard; {
		store(sentinel)
		_, err := c.Delete([]kvcache.Key{sentinel})
		require.NoError(t, err)
		select {
		case m := <-msgs:
			heard, last = true, m.seq
		case <-time.After(100 * time.Millisecond):
		}
	}
	drain := time.After(200 * time.Millisecond)
	for drained := false; !drained; {
		select {
		case m := <-msgs:
			require.Equal(t, last+1, m.seq, "no gap in the sequence")
			last = m.seq
		case <-drain:
			drained = true
		}
	}

	k1, k2 := kvcache.Key{1}, kvcache.Key{2}
	store(k1, k2)
	_, err = c.Delete([]kvcache.Key{k1})
	require.NoError(t, err)
	want := []nodeEvent{{"BlockStored", k1, "CPU"}, {"BlockStored", k2, "CPU"}, {"BlockRemoved", k1, "CPU"}}
	var got []nodeEvent
	deadline := time.After(10 * time.Second)
	for len(got) < len(want) {
		select {
		case m := <-msgs:
			require.Equal(t, last+1, m.seq, "no gap in the sequence")
			last = m.seq
			got = append(got, m.evs...)
		case <-deadline:
			require.Fail(t, "events missing", "got %v, want %v", got, want)
		}
	}
	require.Equal(t, want, got)
	require.NoError(t, c.Close())
	stopServe(t, cmd)
}
