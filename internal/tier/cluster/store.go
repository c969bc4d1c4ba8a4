package cluster

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"math/bits"
	"net"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/redis/rueidis"

	"github.com/kvoffload/kvoffload/internal/tier/record"
)

// Defaults of Config's zero fields.
const (
	DefaultPrefix            = "kvo"
	DefaultTTL               = time.Hour
	DefaultMaxInFlightBytes  = 256 << 20
	DefaultTimeout           = time.Second
	DefaultConnsPerNode      = 2
	DefaultGenerationRefresh = time.Second
	DefaultReconnectMin      = 100 * time.Millisecond
	DefaultReconnectMax      = 5 * time.Second
	DefaultStreams           = 32
)

// closeWaitMax bounds how long Close waits for the client's goroutines
// (the longest sleep among them is the client's 5s delay before closing the
// connections a topology refresh replaced).
const closeWaitMax = 15 * time.Second

// labelKey is the pprof label every goroutine of a store carries (and the
// client's goroutines inherit): Close waits until none with its value runs.
const labelKey = "kvoffload_cluster_store"

var storeSeq atomic.Int64

// Store is a cluster tier: one namespace's records in one Redis Cluster.
type Store struct {
	cfg      Config
	client   atomic.Pointer[clientRef] // nil until connected (Config.Background)
	nsPrefix string                    // <prefix>:<namespace>:
	genKey   string                    // <prefix>:<namespace>:gen
	label    string                    // labelKey's value: this store's goroutines
	lctx     context.Context           // carries the label
	connErr  atomic.Pointer[string]    // the last connect attempt's error while not connected
	attempts atomic.Int64              // connect attempts

	mu            sync.Mutex
	done          *sync.Cond // signalled when a put completes
	closed        bool
	inflightBytes int64
	inflightPuts  int64

	bufs sync.Pool // *[]byte record buffers

	gen                              atomic.Uint64
	puts, putErrors, putOOM, dropped atomic.Int64
	hits, notFound, corrupt, stale   atomic.Int64
	timeouts, errors, clears         atomic.Int64
	unavailPuts, unavailGets         atomic.Int64
	putBytes, hitBytes               atomic.Int64
	stopCtx                          context.Context // cancelled by Close: the connector and the refresher end, their commands at once
	stopCancel                       context.CancelFunc
	streams                          chan struct{}           // a slot per streamed GET in flight (Config.Streams)
	slots                            atomic.Pointer[slotMap] // the masters' slots, for Get's streams (slots.go); nil: not known
	masterSems                       masterSems
	bg                               sync.WaitGroup
}

// clientRef holds the connected client.
type clientRef struct{ c rueidis.Client }

// cl returns the connected client, nil when not connected (yet).
func (s *Store) cl() rueidis.Client {
	if r := s.client.Load(); r != nil {
		return r.c
	}
	return nil
}

// Available reports whether the store has connected to the cluster (always
// true for a store Open returned without Config.Background).
func (s *Store) Available() bool { return s.client.Load() != nil }

// labelled runs f on a goroutine of its own that carries the store's pprof
// label, so that every goroutine the client starts from it carries it too
// (Close waits for them), and waits for it.
func (s *Store) labelled(f func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		pprof.SetGoroutineLabels(s.lctx)
		f()
	}()
	<-done
}

// goLabelled starts f on a goroutine that carries the store's label.
func (s *Store) goLabelled(f func()) {
	go func() {
		pprof.SetGoroutineLabels(s.lctx)
		f()
	}()
}

// Open connects to the cluster and reads the namespace's generation. It
// returns an error (ErrConfig, or the client's) when the configuration is
// invalid or, without Config.Background, when no node of Addrs answers.
// With Config.Background a cluster that does not answer is not an error:
// Open returns a store that is not Available (every put is dropped and
// every Get a miss, counted as unavailable) and keeps connecting in the
// background, with a backoff from Config.ReconnectMin doubling up to
// Config.ReconnectMax, until it connects or is closed.
func Open(ctx context.Context, cfg Config) (*Store, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	id := strconv.FormatInt(storeSeq.Add(1), 10)
	s := &Store{
		cfg:      cfg,
		nsPrefix: cfg.Prefix + ":" + cfg.Namespace + ":",
		genKey:   cfg.Prefix + ":" + cfg.Namespace + ":gen",
		label:    id,
		lctx:     pprof.WithLabels(context.Background(), pprof.Labels(labelKey, id)),
		streams:  make(chan struct{}, cfg.Streams),
	}
	s.done = sync.NewCond(&s.mu)
	s.stopCtx, s.stopCancel = context.WithCancel(context.Background())
	err := s.connect(ctx)
	if err != nil && !cfg.Background {
		s.stopCancel()
		s.waitGoroutines(closeWaitMax)
		return nil, err
	}
	s.bg.Add(1)
	s.goLabelled(func() {
		defer s.bg.Done()
		if s.cl() == nil && !s.reconnect() {
			return
		}
		s.refresher()
	})
	return s, nil
}

// connect makes one attempt: a client, and the namespace's generation read
// through it. On success the store is Available.
func (s *Store) connect(ctx context.Context) error {
	s.attempts.Add(1)
	cfg := &s.cfg
	opt := rueidis.ClientOption{
		InitAddress:       append([]string(nil), cfg.Addrs...),
		Username:          cfg.Username,
		Password:          cfg.Password,
		TLSConfig:         cfg.TLS,
		DisableCache:      true, // no client-side caching: records are read once, into the pool
		ShuffleInit:       true,
		PipelineMultiplex: bits.TrailingZeros(uint(cfg.ConnsPerNode)),
		// No background PING (a negative KeepAlive): the client sends it
		// from a timer's goroutine, which carries no label, and a failed
		// one schedules a topology refresh from there, which Close could
		// then not wait for. Every command here has a deadline, which finds
		// a dead node as well; TCP keep-alive stays on.
		Dialer: net.Dialer{Timeout: cfg.Timeout, KeepAlive: -1,
			KeepAliveConfig: net.KeepAliveConfig{Enable: true, Idle: 15 * time.Second, Interval: 15 * time.Second, Count: 9}},
		ConnWriteTimeout: cfg.Timeout,
		// Smaller than the client's 512 KiB defaults: a value larger than
		// the write buffer goes from the record buffer to the socket (with
		// a StringWriter conn, below) instead of through the buffer, and a
		// reply larger than the read buffer is read straight into the
		// reply's own bytes. The write buffer is small (4 KiB): behind a
		// SET's header bufio first fills what is left of it with the
		// value's head (a copy) and flushes, and only the rest goes
		// straight; with 64 KiB that copy was 64 KiB a record, and PutAsync
		// ran 8% slower at 256 KiB records (TestBenchVsRedisBenchmark,
		// alternating, on the 2-CPU VM). A batch of GETs still fits.
		ReadBufferEachConn:  ioBuffers.read,
		WriteBufferEachConn: ioBuffers.write,
		MaxFlushDelay:       ioBuffers.flushDelay,
		BlockingPoolSize:    cfg.Streams, // streamed GETs' connections, per node
	}
	if ioBuffers.stringConn {
		opt.DialCtxFn = dialStringConn
	}
	var client rueidis.Client
	var err error
	s.labelled(func() {
		client, err = rueidis.NewClient(opt)
		if err != nil {
			err = fmt.Errorf("cluster: connect to %v: %w", cfg.Addrs, err)
			return
		}
		// Given one address of a node that is not (yet) in a cluster, the
		// client falls back to a plain connection to it: not a cluster
		// tier (every other node's slots would fail), so not connected.
		if m := client.Mode(); m != rueidis.ClientModeCluster {
			client.Close()
			err = fmt.Errorf("cluster: %v answers as a %s server, not a Redis Cluster (cluster mode off, or the cluster not created yet)", cfg.Addrs, m)
			return
		}
		if err = s.refreshGenerationWith(ctx, client); err != nil {
			client.Close()
			err = fmt.Errorf("cluster: read generation %s: %w", s.genKey, err)
			return
		}
		_ = s.refreshSlots(ctx, client) // without a map Get's streams go in key order
	})
	if err != nil {
		msg := err.Error()
		s.connErr.Store(&msg)
		return err
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		client.Close()
		return ErrClosed
	}
	s.client.Store(&clientRef{client})
	s.connErr.Store(nil)
	s.mu.Unlock()
	return nil
}

// ioBuffers are the client's per-connection buffers and its write loop's
// flush delay (variables for the benchmarks to compare).
var ioBuffers = struct {
	read, write int
	flushDelay  time.Duration
	stringConn  bool
	stream      bool // Get streams each record (stream.go) instead of pipelining the batch
	copyWays    int  // a put's copy: 0 record.CopyChecksum's ways, > 0 at most that many, < 0 half the cores shared out among the puts in flight
	perMaster   bool // Get's streams shared out by master when the slot map is known (slots.go)
}{read: 64 << 10, write: 4 << 10, stringConn: true, stream: true, perMaster: true}

// copyChecksum is record.CopyChecksum of a put's payload behind its header,
// on as many goroutines as ioBuffers.copyWays says, given the puts in flight
// (this one included).
func copyChecksum(dst, src []byte, inflight int64) uint32 {
	switch w := ioBuffers.copyWays; {
	case w > 0:
		return record.CopyChecksumWays(dst, src, w)
	case w < 0:
		return record.CopyChecksumWays(dst, src, max(1, runtime.GOMAXPROCS(0)/2/int(inflight)))
	}
	return record.CopyChecksum(dst, src)
}

// stringConn is a net.Conn that is an io.StringWriter: the client's
// bufio.Writer hands a string larger than its free space (a record's value,
// written as a string) to WriteString once its buffer is flushed, which
// writes the string's bytes to the socket without copying them.
type stringConn struct{ net.Conn }

func (c stringConn) WriteString(s string) (int, error) {
	return c.Write(unsafe.Slice(unsafe.StringData(s), len(s)))
}

// dialStringConn is the client's dial (TCP, or TLS when set) returning a
// stringConn.
func dialStringConn(ctx context.Context, dst string, d *net.Dialer, cfg *tls.Config) (net.Conn, error) {
	var conn net.Conn
	var err error
	if cfg != nil {
		conn, err = (&tls.Dialer{NetDialer: d, Config: cfg}).DialContext(ctx, "tcp", dst)
	} else {
		conn, err = d.DialContext(ctx, "tcp", dst)
	}
	if err != nil {
		return nil, err
	}
	return stringConn{conn}, nil
}

// reconnect retries connect with backoff until it succeeds (true) or the
// store is closed (false).
func (s *Store) reconnect() bool {
	wait := s.cfg.ReconnectMin
	for {
		t := time.NewTimer(wait)
		select {
		case <-s.stopCtx.Done():
			t.Stop()
			return false
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*s.cfg.Timeout)
		err := s.connect(ctx)
		cancel()
		if err == nil {
			return true
		}
		if errors.Is(err, ErrClosed) {
			return false
		}
		wait = min(2*wait, s.cfg.ReconnectMax)
	}
}

func (c *Config) fill() error {
	if len(c.Addrs) == 0 {
		return fmt.Errorf("%w: Addrs is empty", ErrConfig)
	}
	if c.Namespace == "" {
		return fmt.Errorf("%w: Namespace is empty", ErrConfig)
	}
	if c.Prefix == "" {
		c.Prefix = DefaultPrefix
	}
	if c.TTL == 0 {
		c.TTL = DefaultTTL
	}
	if c.TTL < time.Millisecond {
		return fmt.Errorf("%w: TTL %v under 1ms", ErrConfig, c.TTL)
	}
	if c.MaxInFlightBytes == 0 {
		c.MaxInFlightBytes = DefaultMaxInFlightBytes
	}
	if c.MaxInFlightBytes < 0 {
		return fmt.Errorf("%w: MaxInFlightBytes %d is negative", ErrConfig, c.MaxInFlightBytes)
	}
	if c.Timeout == 0 {
		c.Timeout = DefaultTimeout
	}
	if c.Timeout < 0 {
		return fmt.Errorf("%w: Timeout %v is negative", ErrConfig, c.Timeout)
	}
	if c.ConnsPerNode == 0 {
		c.ConnsPerNode = DefaultConnsPerNode
	}
	if c.ConnsPerNode < 0 || c.ConnsPerNode > 1<<rueidis.MaxPipelineMultiplex || c.ConnsPerNode&(c.ConnsPerNode-1) != 0 {
		return fmt.Errorf("%w: ConnsPerNode %d is not a power of two up to %d", ErrConfig, c.ConnsPerNode, 1<<rueidis.MaxPipelineMultiplex)
	}
	if c.GenerationRefresh == 0 {
		c.GenerationRefresh = DefaultGenerationRefresh
	}
	if c.Streams == 0 {
		c.Streams = DefaultStreams
	}
	if c.Streams < 0 {
		return fmt.Errorf("%w: Streams %d is negative", ErrConfig, c.Streams)
	}
	if c.ReconnectMin == 0 {
		c.ReconnectMin = DefaultReconnectMin
	}
	if c.ReconnectMax == 0 {
		c.ReconnectMax = max(DefaultReconnectMax, c.ReconnectMin)
	}
	if c.ReconnectMin < 0 || c.ReconnectMax < c.ReconnectMin {
		return fmt.Errorf("%w: ReconnectMin %v, ReconnectMax %v: want 0 < min <= max", ErrConfig, c.ReconnectMin, c.ReconnectMax)
	}
	return nil
}

// key is a record's key: <prefix>:<namespace>:<gen>:<hex key>.
func (s *Store) key(gen uint64, k [16]byte) string {
	b := make([]byte, 0, len(s.nsPrefix)+21+2*len(k))
	b = append(b, s.nsPrefix...)
	b = strconv.AppendUint(b, gen, 10)
	b = append(b, ':')
	b = hex.AppendEncode(b, k[:])
	return string(b)
}

// PutAsync writes the record of key and payload through to the cluster, in
// the background. The payload is copied (behind the record's header) before
// PutAsync returns, so the caller may reuse it at once. It returns false, and
// counts a drop, when the store is closed or when the record would take the
// bytes in flight over Config.MaxInFlightBytes, or when the store is not
// Available (counted apart too); otherwise Config.OnPutDone (if set) is
// called once when the cluster has answered.
func (s *Store) PutAsync(key [16]byte, payload []byte) bool {
	return s.putAsync(key, payload, nil)
}

// PutAsyncFrom is PutAsync for a payload the caller keeps unchanged until
// release is called: the copy behind the record's header, and its
// checksum, are made on the put's own goroutine instead of the caller's
// (a 2 MiB payload's copy and CRC are a few hundred µs of the caller's
// thread otherwise). When it returns true, release is called exactly once,
// from another goroutine, as soon as the payload has been copied (before
// the cluster answers); when it returns false (a drop, counted as
// PutAsync's), release is never called and the payload is the caller's
// again at once. release must not block.
func (s *Store) PutAsyncFrom(key [16]byte, payload []byte, release func()) bool {
	if release == nil {
		release = func() {}
	}
	return s.putAsync(key, payload, release)
}

// putAsync is PutAsync (release nil: copied on the caller's goroutine) and
// PutAsyncFrom (copied on the put's, then release).
func (s *Store) putAsync(key [16]byte, payload []byte, release func()) bool {
	n := int64(record.HeaderSize + len(payload))
	client := s.cl()
	if client == nil {
		s.unavailPuts.Add(1)
		s.dropped.Add(1)
		return false
	}
	s.mu.Lock()
	if s.closed || s.inflightBytes+n > s.cfg.MaxInFlightBytes {
		s.mu.Unlock()
		s.dropped.Add(1)
		return false
	}
	s.inflightBytes += n
	s.inflightPuts++
	inflight := s.inflightPuts
	s.mu.Unlock()
	gen := s.gen.Load()
	// The payload's CRC on each piece of the copy while it is in the cache
	// (one pass over memory, not two).
	if release == nil {
		bp := s.buffer(int(n))
		sum := copyChecksum((*bp)[record.HeaderSize:], payload, inflight)
		s.goLabelled(func() { s.put(client, key, gen, bp, sum) })
		return true
	}
	s.goLabelled(func() {
		bp := s.buffer(int(n))
		sum := copyChecksum((*bp)[record.HeaderSize:], payload, inflight)
		release()
		s.put(client, key, gen, bp, sum)
	})
	return true
}

// buffer returns a record buffer of n bytes from the pool.
func (s *Store) buffer(n int) *[]byte {
	if bp, _ := s.bufs.Get().(*[]byte); bp != nil && cap(*bp) >= n {
		*bp = (*bp)[:n]
		return bp
	}
	b := make([]byte, n)
	return &b
}

// put writes the record in *bp (its payload behind the header's room,
// whose CRC-32C is sum) and answers the put.
func (s *Store) put(client rueidis.Client, key [16]byte, gen uint64, bp *[]byte, sum uint32) {
	buf := *bp
	payload := buf[record.HeaderSize:]
	record.EncodeHeader(buf, record.Header{
		LayoutVersion: record.HostLayoutVersion,
		Fingerprint:   s.cfg.Fingerprint,
		Key:           key,
		PayloadLen:    uint64(len(payload)),
		PayloadSum:    sum,
	})
	err := s.cfg.faults.inject(opPut)
	if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), s.cfg.Timeout)
		// BinaryString aliases buf: on success the client has written it
		// to the socket before Do returns; on a failure (a deadline, say)
		// it may still be queued, so buf is not reused (below).
		cmd := client.B().Set().Key(s.key(gen, key)).Value(rueidis.BinaryString(buf)).
			Px(s.cfg.TTL).Build()
		err = client.Do(ctx, cmd).Error()
		cancel()
	}
	if err == nil {
		s.puts.Add(1)
		s.putBytes.Add(int64(len(payload)))
	} else {
		s.putErrors.Add(1)
		if re, ok := rueidis.IsRedisErr(err); ok && strings.HasPrefix(re.Error(), "OOM") {
			s.putOOM.Add(1)
		}
	}
	if err == nil {
		s.bufs.Put(bp)
	} // else the client may still write buf: left to the collector
	// The put's bytes are free before OnPutDone runs (a caller may put
	// again from it), but the put counts until it has returned, so that
	// Flush returns only after the callbacks of the puts it waited for.
	s.mu.Lock()
	s.inflightBytes -= int64(len(buf))
	s.mu.Unlock()
	if s.cfg.OnPutDone != nil {
		s.cfg.OnPutDone(key, err == nil)
	}
	s.mu.Lock()
	s.inflightPuts--
	s.done.Broadcast()
	s.mu.Unlock()
}

// Flush waits until every put accepted so far has been answered and its
// Config.OnPutDone (if set) has returned.
func (s *Store) Flush() {
	s.mu.Lock()
	for s.inflightPuts > 0 {
		s.done.Wait()
	}
	s.mu.Unlock()
}

// Get reads the records of keys into dsts (dsts[i] must be of the payload's
// size), concurrently: the keys' GETs go to their masters at once, up to
// Config.Streams of them in flight store-wide (see the package doc). It
// waits until ctx's deadline or Config.Timeout, whichever comes first. ok[i] is true only when dsts[i] holds the verified payload of
// keys[i]; otherwise it is a miss, counted, and dsts[i] is untouched. A
// store not Available answers every key a miss (Stats.Unavailable) at once,
// without looking at dsts. It panics if len(dsts) != len(keys).
func (s *Store) Get(ctx context.Context, keys [][16]byte, dsts [][]byte) []bool {
	return s.get(ctx, keys, dsts, false)
}

// GetDirect is Get without the copy of each verified record into its
// destination: a streamed reply's payload is received straight into
// dsts[i] and verified there. ok[i] is still true only when dsts[i] holds
// the verified payload of keys[i], but a destination whose result is false
// holds undefined bytes (part of a record that failed a check, or of a
// reply cut short). It is for destinations nobody reads unless their
// result is true, as the engine's promotion into reserved pool slots.
func (s *Store) GetDirect(ctx context.Context, keys [][16]byte, dsts [][]byte) []bool {
	return s.get(ctx, keys, dsts, true)
}

func (s *Store) get(ctx context.Context, keys [][16]byte, dsts [][]byte, direct bool) []bool {
	if len(dsts) != len(keys) {
		panic(fmt.Sprintf("cluster: Get of %d keys into %d destinations", len(keys), len(dsts)))
	}
	ok := make([]bool, len(keys))
	if len(keys) == 0 {
		return ok
	}
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		s.errors.Add(int64(len(keys)))
		return ok
	}
	client := s.cl()
	if client == nil {
		s.unavailGets.Add(int64(len(keys)))
		return ok
	}
	if err := s.cfg.faults.inject(opGet); err != nil {
		for range keys {
			s.countMiss(err)
		}
		return ok
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	gen := s.gen.Load()
	if ioBuffers.stream {
		var m *slotMap // nil: the keys in order (slots.go)
		if ioBuffers.perMaster {
			m = s.slots.Load()
		}
		s.getByMaster(ctx, client, m, gen, keys, dsts, direct, ok)
		return ok
	}
	cmds := make(rueidis.Commands, len(keys))
	for i, k := range keys {
		cmds[i] = client.B().Get().Key(s.key(gen, k)).Build()
	}
	var rs []rueidis.RedisResult
	s.labelled(func() { rs = client.DoMulti(ctx, cmds...) })
	for i, r := range rs {
		ok[i] = s.fill(r, keys[i], dsts[i])
	}
	return ok
}

// fill verifies the reply r of key and copies its payload into dst.
func (s *Store) fill(r rueidis.RedisResult, key [16]byte, dst []byte) bool {
	v, err := r.AsBytes() // aliases the reply: read only
	if err != nil {
		s.countMiss(err)
		return false
	}
	if !s.count(record.Accept(v, len(v), func() uint32 { return record.Checksum(v[record.HeaderSize:]) }, s.cfg.Fingerprint, key, len(dst)), len(dst)) {
		return false
	}
	copy(dst, v[record.HeaderSize:])
	return true
}

// count counts a reply's accept decision (record.Accept: a hit of n
// bytes, a stale record, or a corrupt one) and reports whether it was
// accepted.
func (s *Store) count(err error, n int) bool {
	switch {
	case err == nil:
		s.hits.Add(1)
		s.hitBytes.Add(int64(n))
		return true
	case record.Stale(err):
		s.stale.Add(1)
	default:
		s.corrupt.Add(1)
	}
	return false
}

func (s *Store) countMiss(err error) {
	var ne net.Error
	switch {
	case rueidis.IsRedisNil(err):
		s.notFound.Add(1)
	case errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ne) && ne.Timeout():
		s.timeouts.Add(1)
	default:
		s.errors.Add(1)
	}
}

// Clear makes every record of the namespace unreachable at once by bumping
// its generation (INCR <prefix>:<namespace>:gen); the old records expire by
// TTL. Other stores of the namespace see the new generation within their
// GenerationRefresh. Puts in flight may still land in the old generation.
// A store not Available cannot clear: the error says so.
func (s *Store) Clear(ctx context.Context) error {
	client := s.cl()
	if client == nil {
		return fmt.Errorf("cluster: clear %s: not connected", s.genKey)
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	var err error
	s.labelled(func() { err = s.clear(ctx, client) })
	return err
}

func (s *Store) clear(ctx context.Context, client rueidis.Client) error {
	n, err := client.Do(ctx, client.B().Incr().Key(s.genKey).Build()).AsInt64()
	if err != nil {
		return fmt.Errorf("cluster: clear %s: %w", s.genKey, err)
	}
	if seen := s.gen.Load(); uint64(n) <= seen {
		// The generation key was lost (evicted, flushed): move it past
		// every generation this store has used.
		n, err = client.Do(ctx, client.B().Incrby().Key(s.genKey).Increment(int64(seen)+1-n).Build()).AsInt64()
		if err != nil {
			return fmt.Errorf("cluster: clear %s: %w", s.genKey, err)
		}
	}
	s.raiseGeneration(uint64(n))
	s.clears.Add(1)
	return nil
}

func (s *Store) raiseGeneration(g uint64) {
	for {
		cur := s.gen.Load()
		if g <= cur || s.gen.CompareAndSwap(cur, g) {
			return
		}
	}
}

// refreshGenerationWith reads the generation through client (on a labelled
// goroutine).
func (s *Store) refreshGenerationWith(ctx context.Context, client rueidis.Client) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	g, err := client.Do(ctx, client.B().Get().Key(s.genKey).Build()).AsUint64()
	if rueidis.IsRedisNil(err) {
		return nil
	}
	if err != nil {
		return err
	}
	s.raiseGeneration(g)
	return nil
}

// refresher re-reads the generation every GenerationRefresh until Close (on
// a labelled goroutine, once connected).
func (s *Store) refresher() {
	if s.cfg.GenerationRefresh < 0 {
		<-s.stopCtx.Done()
		return
	}
	t := time.NewTicker(s.cfg.GenerationRefresh)
	defer t.Stop()
	for {
		select {
		case <-s.stopCtx.Done():
			return
		case <-t.C:
			_ = s.refreshGenerationWith(s.stopCtx, s.cl()) // a failure keeps the generation known
			_ = s.refreshSlots(s.stopCtx, s.cl())          // and the slot map
		}
	}
}

// Close refuses new puts, waits for those in flight (each bounded by
// Config.Timeout), stops connecting, closes the connections and waits until
// every goroutine of the store and of its client has ended: the client's own
// background work (a topology refresh it had scheduled, connections it
// closes late) can take seconds after a node failed or the topology changed,
// and 5s when a refresh replaced a connection (the client closes the old
// one 5s later: on the VM, one Close in about ten after 3000 puts).
// Later Gets are misses.
func (s *Store) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	s.Flush()
	s.stopCancel()
	s.bg.Wait()
	if c := s.cl(); c != nil {
		// Labelled: the client closes its connections on goroutines of its
		// own, which must carry the label for the wait below to see them
		// (and what they start: a topology refresh scheduled by a
		// connection's close hook).
		s.labelled(c.Close)
	}
	s.waitGoroutines(closeWaitMax)
	// A connection the client closes from a timer of its own (a goroutine
	// with no label: a connection's lifetime, a stuck drain's escape) runs
	// the close hook there, which schedules a topology refresh that first
	// sleeps up to the refresh delay: a goroutine of this client that the
	// label does not mark. Wait for such sleepers too, bounded by that
	// delay (one of another store's in the process makes Close wait for
	// it as well).
	waitUnlabelledRefresh(refreshWaitMax)
	return nil
}

// refreshWaitMax bounds waitUnlabelledRefresh: more than the client's
// longest delay before a scheduled topology refresh (1s).
const refreshWaitMax = 1500 * time.Millisecond

// waitUnlabelledRefresh waits, up to d, until no goroutine without a pprof
// label sleeps in the Redis client's delayed refresh. It reports whether
// none does.
func waitUnlabelledRefresh(d time.Duration) bool {
	return waitProfile(d, hasUnlabelledRefresh)
}

// hasUnlabelledRefresh reports whether a goroutine profile (debug=1: one
// block a distinct stack and label set, blocks separated by blank lines,
// labels on a "# labels:" line) holds a goroutine in the client's delayed
// refresh that carries no label.
func hasUnlabelledRefresh(profile []byte) bool {
	for _, blk := range bytes.Split(profile, []byte("\n\n")) {
		if bytes.Contains(blk, []byte("rueidis.(*call).DelayDo")) && !bytes.Contains(blk, []byte("# labels:")) {
			return true
		}
	}
	return false
}

// waitGoroutines waits, up to d, until no goroutine carries the store's
// label. It reports whether none does.
func (s *Store) waitGoroutines(d time.Duration) bool {
	needle := []byte(strconv.Quote(labelKey) + ":" + strconv.Quote(s.label))
	return waitProfile(d, func(profile []byte) bool { return bytes.Contains(profile, needle) })
}

// waitProfile waits, up to d, until the goroutine profile (debug=1) no
// longer matches busy, polling at growing intervals. It reports whether
// it stopped matching.
func waitProfile(d time.Duration, busy func(profile []byte) bool) bool {
	var buf bytes.Buffer
	wait := time.Millisecond
	for deadline := time.Now().Add(d); ; {
		buf.Reset()
		if err := pprof.Lookup("goroutine").WriteTo(&buf, 1); err != nil || !busy(buf.Bytes()) {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(wait)
		wait = min(2*wait, 50*time.Millisecond)
	}
}
