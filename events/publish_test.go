package events_test

import (
	"context"
	"encoding/binary"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvoffload/kvoffload/events"
	"github.com/kvoffload/kvoffload/offload"
	"github.com/stretchr/testify/require"
)

// TestPublish: a batch Publish is given goes out as one message
// [topic, seq, KVEventBatch], the sequence counting on by one, and is
// counted in Sent.
func TestPublish(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pub, err := events.Listen(ctx, "tcp://127.0.0.1:0", events.Options{Topic: "node"})
	require.NoError(t, err)
	defer pub.Close()
	sub := zmq4.NewSub(ctx)
	defer sub.Close()
	require.NoError(t, sub.Dial("tcp://"+pub.Addr().String()))
	require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, "node"))
	msgs := make(chan message, 1024)
	go func() {
		defer close(msgs)
		for {
			m, err := sub.Recv()
			if err != nil {
				return
			}
			if len(m.Frames) != 3 || string(m.Frames[0]) != "node" || len(m.Frames[1]) != 8 {
				t.Errorf("frames: %q", m.Frames)
				continue
			}
			msgs <- message{seq: binary.BigEndian.Uint64(m.Frames[1]), payload: m.Frames[2]}
		}
	}()
	// A PUB socket drops what it sends before the subscription arrives.
	var last uint64
	for heard := false; !heard; {
		require.NoError(t, pub.Publish([]offload.Event{{Kind: offload.EventCleared}}))
		select {
		case m := <-msgs:
			heard, last = true, m.seq
		case <-time.After(100 * time.Millisecond):
		}
	}
	for drained := false; !drained; {
		select {
		case m := <-msgs:
			last = m.seq
		case <-time.After(200 * time.Millisecond):
			drained = true
		}
	}
	sent := pub.Sent()
	var k offload.Key
	k[0] = 3
	evs := []offload.Event{
		{Kind: offload.EventStored, Key: k, Medium: offload.MediumCPU},
		{Kind: offload.EventRemoved, Key: k, Medium: offload.MediumCPU},
	}
	require.NoError(t, pub.Publish(evs))
	select {
	case m := <-msgs:
		require.Equal(t, last+1, m.seq)
		require.Equal(t, evs, decodeBatch(t, m.payload), "one message, the whole batch")
	case <-time.After(10 * time.Second):
		t.Fatal("the batch did not arrive")
	}
	require.Equal(t, sent+2, pub.Sent())
	require.Zero(t, pub.SendErrors())
}
