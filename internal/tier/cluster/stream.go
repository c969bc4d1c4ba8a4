package cluster

import (
	"context"
	"hash/crc32"
	"io"
	"sync"
	"time"

	"github.com/redis/rueidis"

	"github.com/kvoffload/kvoffload/internal/tier/record"
)

// Streamed reads. A pipelined GET (DoMulti) receives each reply into a
// string the client allocates (a large allocation, zeroed, then collected),
// which Get verifies and copies: three passes over every byte besides the
// socket's. A streamed GET (the client's DoStream, one request at a time on
// a connection of the node's stream pool) hands the reply's bytes to
// recvBuf.ReadFrom as they come off the socket: the header lands in a
// pooled buffer, the payload in a pooled buffer too (Get: only a verified
// record is copied into the destination) or straight in the destination
// (GetDirect), and the payload's CRC-32C is computed on each piece while
// it is in the cache. DoStream neither follows redirections nor retries,
// so any failure other than an absent key falls back to the pipelined GET,
// which does (MOVED and ASK during a reshard, a node that failed over).

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// recvBuf receives one GET reply: up to record.HeaderSize+len(body) bytes,
// the header into hdr and the payload into body; a longer reply is drained
// and marked over.
type recvBuf struct {
	hdr   []byte // record.HeaderSize bytes
	own   []byte // the pooled payload buffer body is, when it is not the caller's
	body  []byte
	n     int // bytes received (header first)
	over  bool
	sum   uint32    // CRC-32C of the payload bytes received
	first time.Time // when the first byte came (only while streamTimes is set)
}

// streamTimes, when set (by a benchmark, before it starts a store's gets,
// and cleared after they have returned), is called once per streamed GET
// that was received whole, with when the request was sent, when the
// reply's first byte came and when its last did: the server's queue and
// the reply's transfer, apart.
var streamTimes func(sent, first, done time.Time)

// reset prepares w for a reply whose payload has n bytes, received into dst
// when dst is not nil (then len(dst) == n), else into w's own buffer.
func (w *recvBuf) reset(n int, dst []byte) {
	if w.hdr == nil {
		w.hdr = make([]byte, record.HeaderSize)
	}
	if dst != nil {
		w.body = dst
	} else {
		if cap(w.own) < n {
			w.own = make([]byte, n)
		}
		w.body = w.own[:n]
	}
	w.n, w.over, w.sum, w.first = 0, false, 0, time.Time{}
}

// release drops w's reference to a caller's destination before w goes
// back to the pool.
func (w *recvBuf) release() { w.body = nil }

// next is where the next bytes go: the rest of the header, then the rest of
// the payload; empty once both are full.
func (w *recvBuf) next() []byte {
	if w.n < record.HeaderSize {
		return w.hdr[w.n:]
	}
	return w.body[w.n-record.HeaderSize:]
}

// took accounts for next()[:m] having been filled.
func (w *recvBuf) took(m int) {
	if w.n == 0 && m > 0 && streamTimes != nil {
		w.first = time.Now()
	}
	if w.n >= record.HeaderSize {
		off := w.n - record.HeaderSize
		w.sum = crc32.Update(w.sum, castagnoli, w.body[off:off+m])
	}
	w.n += m
}

// ReadFrom reads the reply's bytes from r (the connection's buffered
// reader, limited to the reply) into hdr and body; io.Copy calls it.
func (w *recvBuf) ReadFrom(r io.Reader) (int64, error) {
	var total int64
	for {
		to := w.next()
		if len(to) == 0 {
			m, err := io.Copy(io.Discard, r)
			if m > 0 {
				w.over = true
			}
			return total + m, err
		}
		m, err := r.Read(to)
		w.took(m)
		total += int64(m)
		if err == io.EOF {
			return total, nil
		}
		if err != nil {
			return total, err
		}
	}
}

// Write takes a reply the client hands over whole (not a bulk string).
func (w *recvBuf) Write(p []byte) (int, error) {
	total := len(p)
	for len(p) > 0 {
		to := w.next()
		if len(to) == 0 {
			w.over = true
			break
		}
		m := copy(to, p)
		w.took(m)
		p = p[m:]
	}
	return total, nil
}

var recvBufs = sync.Pool{New: func() any { return new(recvBuf) }}

// getStreamed reads key's record (its cluster key rkey) into dst by a
// streamed GET, falling back to a pipelined one on a failure other than an
// absent key while ctx lasts. It counts the outcome like fill. With direct
// the payload is received straight into dst (whatever it turns out to be);
// otherwise dst is written only with a verified payload.
func (s *Store) getStreamed(ctx context.Context, client rueidis.Client, rkey string, key [16]byte, dst []byte, direct bool) bool {
	w := recvBufs.Get().(*recvBuf)
	defer func() {
		w.release()
		recvBufs.Put(w)
	}()
	if direct {
		w.reset(len(dst), dst)
	} else {
		w.reset(len(dst), nil)
	}
	var sent time.Time
	if streamTimes != nil {
		sent = time.Now()
	}
	st := client.DoStream(ctx, client.B().Get().Key(rkey).Build())
	_, err := st.WriteTo(w)
	if streamTimes != nil && err == nil && !w.first.IsZero() {
		streamTimes(sent, w.first, time.Now())
	}
	switch {
	case rueidis.IsRedisNil(err):
		s.notFound.Add(1)
		return false
	case err != nil && ctx.Err() == nil:
		return s.fill(client.Do(ctx, client.B().Get().Key(rkey).Build()), key, dst)
	case err != nil:
		s.countMiss(err)
		return false
	case w.over:
		s.corrupt.Add(1)
		return false
	}
	if !s.count(record.Accept(w.hdr, w.n, func() uint32 { return w.sum }, s.cfg.Fingerprint, key, len(dst)), len(dst)) {
		return false
	}
	if !direct {
		copy(dst, w.body)
	}
	return true
}
