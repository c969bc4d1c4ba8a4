package cluster

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"math/bits"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/rueidis"

	"github.com/kvoffload/kvoffload/tier/record"
)

// Defaults of Config's zero fields.
const (
	DefaultPrefix            = "kvo"
	DefaultTTL               = time.Hour
	DefaultMaxInFlightBytes  = 256 << 20
	DefaultTimeout           = time.Second
	DefaultConnsPerNode      = 2
	DefaultGenerationRefresh = time.Second
)

// Store is a cluster tier: one namespace's records in one Redis Cluster.
type Store struct {
	cfg      Config
	client   rueidis.Client
	nsPrefix string // <prefix>:<namespace>:
	genKey   string // <prefix>:<namespace>:gen

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
	stopRefresh                      chan struct{}
	refreshDone                      chan struct{}
}

// Open connects to the cluster and reads the namespace's generation. It
// returns an error (ErrConfig, or the client's) when the configuration is
// invalid or no node of Addrs answers: the engine then runs without the tier.
func Open(ctx context.Context, cfg Config) (*Store, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	opt := rueidis.ClientOption{
		InitAddress:       cfg.Addrs,
		Username:          cfg.Username,
		Password:          cfg.Password,
		TLSConfig:         cfg.TLS,
		DisableCache:      true, // no client-side caching: records are read once, into the pool
		ShuffleInit:       true,
		PipelineMultiplex: bits.TrailingZeros(uint(cfg.ConnsPerNode)),
		Dialer:            net.Dialer{Timeout: cfg.Timeout},
		ConnWriteTimeout:  cfg.Timeout,
	}
	client, err := rueidis.NewClient(opt)
	if err != nil {
		return nil, fmt.Errorf("cluster: connect to %v: %w", cfg.Addrs, err)
	}
	s := &Store{
		cfg:         cfg,
		client:      client,
		nsPrefix:    cfg.Prefix + ":" + cfg.Namespace + ":",
		genKey:      cfg.Prefix + ":" + cfg.Namespace + ":gen",
		stopRefresh: make(chan struct{}),
		refreshDone: make(chan struct{}),
	}
	s.done = sync.NewCond(&s.mu)
	if err := s.refreshGeneration(ctx); err != nil {
		client.Close()
		return nil, fmt.Errorf("cluster: read generation %s: %w", s.genKey, err)
	}
	go s.refresher()
	return s, nil
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
// bytes in flight over Config.MaxInFlightBytes; otherwise Config.OnPutDone (if
// set) is called once when the cluster has answered.
func (s *Store) PutAsync(key [16]byte, payload []byte) bool {
	n := int64(record.HeaderSize + len(payload))
	s.mu.Lock()
	if s.closed || s.inflightBytes+n > s.cfg.MaxInFlightBytes {
		s.mu.Unlock()
		s.dropped.Add(1)
		return false
	}
	s.inflightBytes += n
	s.inflightPuts++
	s.mu.Unlock()
	bp := s.buffer(int(n))
	copy((*bp)[record.HeaderSize:], payload)
	go s.put(key, s.gen.Load(), bp)
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

func (s *Store) put(key [16]byte, gen uint64, bp *[]byte) {
	buf := *bp
	payload := buf[record.HeaderSize:]
	record.EncodeHeader(buf, record.Header{
		LayoutVersion: record.HostLayoutVersion,
		Fingerprint:   s.cfg.Fingerprint,
		Key:           key,
		PayloadLen:    uint64(len(payload)),
		PayloadSum:    record.Checksum(payload),
	})
	err := s.cfg.faults.inject(opPut)
	if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), s.cfg.Timeout)
		// BinaryString aliases buf: the client writes it to the socket
		// before Do returns, and buf goes back to the pool only after.
		cmd := s.client.B().Set().Key(s.key(gen, key)).Value(rueidis.BinaryString(buf)).
			Px(s.cfg.TTL).Build()
		err = s.client.Do(ctx, cmd).Error()
		cancel()
	}
	if err == nil {
		s.puts.Add(1)
	} else {
		s.putErrors.Add(1)
		if re, ok := rueidis.IsRedisErr(err); ok && strings.HasPrefix(re.Error(), "OOM") {
			s.putOOM.Add(1)
		}
	}
	s.bufs.Put(bp)
	s.mu.Lock()
	s.inflightBytes -= int64(len(buf))
	s.inflightPuts--
	s.done.Broadcast()
	s.mu.Unlock()
	if s.cfg.OnPutDone != nil {
		s.cfg.OnPutDone(key, err == nil)
	}
}

// Flush waits until every put accepted so far has been answered.
func (s *Store) Flush() {
	s.mu.Lock()
	for s.inflightPuts > 0 {
		s.done.Wait()
	}
	s.mu.Unlock()
}

// Get reads the records of keys into dsts (dsts[i] must be of the payload's
// size), pipelined: the keys' GETs go to their masters at once, many per
// round trip. It waits until ctx's deadline or Config.Timeout, whichever
// comes first. ok[i] is true only when dsts[i] holds the verified payload of
// keys[i]; otherwise it is a miss, counted, and dsts[i] is untouched. It
// panics if len(dsts) != len(keys).
func (s *Store) Get(ctx context.Context, keys [][16]byte, dsts [][]byte) []bool {
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
	if err := s.cfg.faults.inject(opGet); err != nil {
		for range keys {
			s.countMiss(err)
		}
		return ok
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	gen := s.gen.Load()
	cmds := make(rueidis.Commands, len(keys))
	for i, k := range keys {
		cmds[i] = s.client.B().Get().Key(s.key(gen, k)).Build()
	}
	for i, r := range s.client.DoMulti(ctx, cmds...) {
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
	h, err := record.DecodeHeader(v)
	switch {
	case err != nil || len(v) < record.HeaderSize:
		s.corrupt.Add(1)
		return false
	case h.Check(s.cfg.Fingerprint, record.HostLayoutVersion) != nil || h.Key != key:
		s.stale.Add(1)
		return false
	case h.PayloadLen != uint64(len(dst)) || record.VerifyPayload(h, v[record.HeaderSize:]) != nil:
		s.corrupt.Add(1)
		return false
	}
	copy(dst, v[record.HeaderSize:])
	s.hits.Add(1)
	return true
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
func (s *Store) Clear(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	n, err := s.client.Do(ctx, s.client.B().Incr().Key(s.genKey).Build()).AsInt64()
	if err != nil {
		return fmt.Errorf("cluster: clear %s: %w", s.genKey, err)
	}
	if seen := s.gen.Load(); uint64(n) <= seen {
		// The generation key was lost (evicted, flushed): move it past
		// every generation this store has used.
		n, err = s.client.Do(ctx, s.client.B().Incrby().Key(s.genKey).Increment(int64(seen)+1-n).Build()).AsInt64()
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

func (s *Store) refreshGeneration(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	g, err := s.client.Do(ctx, s.client.B().Get().Key(s.genKey).Build()).AsUint64()
	if rueidis.IsRedisNil(err) {
		return nil
	}
	if err != nil {
		return err
	}
	s.raiseGeneration(g)
	return nil
}

func (s *Store) refresher() {
	defer close(s.refreshDone)
	if s.cfg.GenerationRefresh < 0 {
		<-s.stopRefresh
		return
	}
	t := time.NewTicker(s.cfg.GenerationRefresh)
	defer t.Stop()
	for {
		select {
		case <-s.stopRefresh:
			return
		case <-t.C:
			_ = s.refreshGeneration(context.Background()) // a failure keeps the generation known
		}
	}
}

// Close refuses new puts, waits for those in flight (each bounded by
// Config.Timeout) and closes the connections. Later Gets are misses.
func (s *Store) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	s.Flush()
	close(s.stopRefresh)
	<-s.refreshDone
	s.client.Close()
	return nil
}
