// Package events publishes an offload.Engine's KV events over ZeroMQ in
// vLLM's schema, for KV-aware routers (llm-d's KV cache manager, Dynamo's
// router) that already subscribe to vLLM.
//
// The schema is vLLM v0.11.2's vllm/distributed/kv_events.py: a PUB socket
// sends multipart messages [topic, seq, payload], seq an 8-byte big-endian
// counter from 0, payload a msgpack KVEventBatch. Every struct there is a
// msgspec Struct with array_like=True and omit_defaults=True, so it is
// encoded as a msgpack array of its fields in order, and the event union
// is tagged (tag=True): the class name is the array's first element.
//
//	KVEventBatch     [ts float64, [event...]]
//	BlockStored      ["BlockStored", [hash...], parent|nil, [token...], block_size, lora_id=nil, medium]
//	BlockRemoved     ["BlockRemoved", [hash...], medium]
//	AllBlocksCleared ["AllBlocksCleared"]
//
// Block hashes are vLLM's ExternalBlockHash (bytes | int); vLLM sends its
// hashes as bytes, so a key goes out as its 16 bytes (msgpack bin 8). The
// medium is offload.MediumCPU ("CPU", as vLLM's CPU offloading names it)
// for the host pool, offload.MediumDisk ("DISK") for the disk tier and
// offload.MediumSharedStorage ("SHARED_STORAGE", as llm-d's storage
// connectors name a tier every engine reads) for the cluster tier, whose
// events are BlockStored only (see offload.MediumSharedStorage).
// Later vLLM (main after v0.15) dropped array_like and encodes the structs
// as maps; this package writes the array form.
//
// Publish sends a batch its caller made: a node's events (`kvoffload
// serve --events`) go out that way, in the same format. The offload
// package does not import this one.
package events

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvoffload/kvoffload/offload"
	"github.com/vmihailenco/msgpack/v5"
)

// AppendBatch returns buf with a KVEventBatch of evs at time ts appended,
// msgpack-encoded as vLLM's msgspec encoder writes it.
func AppendBatch(buf []byte, ts time.Time, evs []offload.Event) ([]byte, error) {
	w := &sliceWriter{b: buf}
	enc := msgpack.NewEncoder(w)
	secs := float64(ts.UnixNano()) / 1e9
	if err := encodeBatch(enc, secs, evs); err != nil {
		return nil, err
	}
	return w.b, nil
}

type sliceWriter struct{ b []byte }

func (w *sliceWriter) Write(p []byte) (int, error) { w.b = append(w.b, p...); return len(p), nil }

func encodeBatch(enc *msgpack.Encoder, ts float64, evs []offload.Event) error {
	if err := enc.EncodeArrayLen(2); err != nil {
		return err
	}
	if err := enc.EncodeFloat64(ts); err != nil {
		return err
	}
	if err := enc.EncodeArrayLen(len(evs)); err != nil {
		return err
	}
	for i := range evs {
		if err := encodeEvent(enc, &evs[i]); err != nil {
			return err
		}
	}
	return nil
}

func encodeEvent(enc *msgpack.Encoder, ev *offload.Event) error {
	var err error
	try := func(e error) {
		if err == nil {
			err = e
		}
	}
	switch ev.Kind {
	case offload.EventStored:
		try(enc.EncodeArrayLen(7))
		try(enc.EncodeString(ev.Kind.String()))
		try(enc.EncodeArrayLen(1))
		try(enc.EncodeBytes(ev.Key[:]))
		if ev.Parent == (offload.Key{}) {
			try(enc.EncodeNil())
		} else {
			try(enc.EncodeBytes(ev.Parent[:]))
		}
		try(enc.EncodeArrayLen(len(ev.Tokens)))
		for _, t := range ev.Tokens {
			try(enc.EncodeUint(uint64(t)))
		}
		try(enc.EncodeInt(int64(ev.BlockSize)))
		try(enc.EncodeNil()) // lora_id
		try(enc.EncodeString(ev.Medium))
	case offload.EventRemoved:
		try(enc.EncodeArrayLen(3))
		try(enc.EncodeString(ev.Kind.String()))
		try(enc.EncodeArrayLen(1))
		try(enc.EncodeBytes(ev.Key[:]))
		try(enc.EncodeString(ev.Medium))
	case offload.EventCleared:
		try(enc.EncodeArrayLen(1))
		try(enc.EncodeString(ev.Kind.String()))
	default:
		return fmt.Errorf("events: unknown event kind %v", ev.Kind)
	}
	return err
}

// Options configure a Publisher.
type Options struct {
	// Topic is the first frame of every message (vLLM's default: empty).
	Topic string
	// MaxBatch bounds the events of one KVEventBatch; default 1024.
	MaxBatch int
}

// Publisher sends an engine's events on a ZeroMQ PUB socket.
type Publisher struct {
	sock   zmq4.Socket
	opts   Options
	mu     sync.Mutex // seq and buf, and each send
	seq    uint64
	buf    []byte       // the batch being sent
	sent   atomic.Int64 // events sent
	errors atomic.Int64 // batches the socket failed to send
}

// Listen binds a PUB socket at endpoint (as vLLM's default, "tcp://*:5557").
func Listen(ctx context.Context, endpoint string, opts Options) (*Publisher, error) {
	if opts.MaxBatch <= 0 {
		opts.MaxBatch = 1024
	}
	sock := zmq4.NewPub(ctx)
	if err := sock.Listen(endpoint); err != nil {
		_ = sock.Close()
		return nil, fmt.Errorf("events: listening at %s: %w", endpoint, err)
	}
	return &Publisher{sock: sock, opts: opts}, nil
}

// Addr is the address the socket listens at (the port chosen for ":0").
func (p *Publisher) Addr() net.Addr { return p.sock.Addr() }

// Sent is the number of events published.
func (p *Publisher) Sent() int64 { return p.sent.Load() }

// SendErrors is the number of batches the socket failed to send.
func (p *Publisher) SendErrors() int64 { return p.errors.Load() }

// Run publishes the stream's events until its channel closes (the engine
// closed, or the stream was closed) or ctx ends: each wake-up takes every
// event waiting (up to MaxBatch) into one KVEventBatch. A PUB socket drops
// messages for subscribers that do not keep up, as vLLM's does past its
// high-water mark; the stream itself counts what the engine dropped
// (EventStream.Dropped).
func (p *Publisher) Run(ctx context.Context, s *offload.EventStream) error {
	batch := make([]offload.Event, 0, p.opts.MaxBatch)
	for {
		batch = batch[:0]
		select {
		case <-ctx.Done():
			return ctx.Err()
		case ev, ok := <-s.C:
			if !ok {
				return nil
			}
			batch = append(batch, ev)
		}
		open := true
	fill:
		for len(batch) < p.opts.MaxBatch {
			select {
			case ev, ok := <-s.C:
				if !ok {
					open = false
					break fill
				}
				batch = append(batch, ev)
			default:
				break fill
			}
		}
		// A failed send is counted (SendErrors) and Run goes on.
		if err, _ := p.publish(batch); err != nil {
			return err
		}
		if !open {
			return nil
		}
	}
}

// Publish sends evs as one KVEventBatch stamped now, a message of its
// own (the next sequence number, whatever MaxBatch): for a source that
// batches its events itself, as a node does (`kvoffload serve --events`:
// its blocks' BlockStored and BlockRemoved of medium CPU, with no parent
// or tokens). Safe to call while Run runs; counted as Run counts (Sent,
// SendErrors).
func (p *Publisher) Publish(evs []offload.Event) error {
	err, sendErr := p.publish(evs)
	if err != nil {
		return err
	}
	return sendErr
}

// publish encodes evs as one KVEventBatch stamped now and sends it: err
// is the encoding's failure (nothing sent), sendErr the socket's (counted
// in SendErrors); the events sent are counted in Sent.
func (p *Publisher) publish(evs []offload.Event) (err, sendErr error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.buf, err = AppendBatch(p.buf[:0], time.Now(), evs); err != nil {
		return err, nil
	}
	if sendErr = p.sendLocked(p.buf); sendErr != nil {
		p.errors.Add(1)
		return nil, sendErr
	}
	p.sent.Add(int64(len(evs)))
	return nil, nil
}

func (p *Publisher) sendLocked(payload []byte) error {
	var seq [8]byte
	binary.BigEndian.PutUint64(seq[:], p.seq)
	p.seq++
	return p.sock.Send(zmq4.NewMsgFrom([]byte(p.opts.Topic), seq[:], append([]byte(nil), payload...)))
}

// Close closes the socket. (go-zeromq/zmq4 v0.17.0 leaves one idle writer
// goroutine of each PUB socket behind: its Close does not stop it.)
func (p *Publisher) Close() error { return p.sock.Close() }
