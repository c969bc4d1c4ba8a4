package cluster

import (
	"context"
	"hash/crc32"
	"io"
	"sync"

	"github.com/redis/rueidis"

	"github.com/kvoffload/kvoffload/tier/record"
)

// Streamed reads. A pipelined GET (DoMulti) receives each reply into a
// string the client allocates (a large allocation, zeroed, then collected),
// which Get verifies and copies: three passes over every byte besides the
// socket's. A streamed GET (the client's DoStream, one request at a time on
// a connection of the node's stream pool) hands the reply's bytes to
// recvBuf.ReadFrom as they come off the socket: they land in a pooled
// buffer, the payload's CRC-32C is computed on each piece while it is in
// the cache, and only a verified record is copied into the destination.
// DoStream neither follows redirections nor retries, so any failure other
// than an absent key falls back to the pipelined GET, which does (MOVED and
// ASK during a reshard, a node that failed over).

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// recvBuf receives one GET reply: up to len(buf) bytes (a header and the
// payload Get expects); a longer reply is drained and marked over.
type recvBuf struct {
	buf  []byte
	n    int
	over bool
	sum  uint32 // CRC-32C of buf[record.HeaderSize:n]
}

func (w *recvBuf) reset(n int) {
	if cap(w.buf) < n {
		w.buf = make([]byte, n)
	}
	w.buf, w.n, w.over, w.sum = w.buf[:n], 0, false, 0
}

// took accounts for buf[w.n:w.n+m] having been filled.
func (w *recvBuf) took(m int) {
	if end := w.n + m; end > record.HeaderSize {
		w.sum = crc32.Update(w.sum, castagnoli, w.buf[max(w.n, record.HeaderSize):end])
	}
	w.n += m
}

// ReadFrom reads the reply's bytes from r (the connection's buffered
// reader, limited to the reply) into buf; io.Copy calls it.
func (w *recvBuf) ReadFrom(r io.Reader) (int64, error) {
	var total int64
	for {
		if w.n == len(w.buf) {
			m, err := io.Copy(io.Discard, r)
			if m > 0 {
				w.over = true
			}
			return total + m, err
		}
		m, err := r.Read(w.buf[w.n:])
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
	m := copy(w.buf[w.n:], p)
	w.took(m)
	if m < len(p) {
		w.over = true
	}
	return len(p), nil
}

var recvBufs = sync.Pool{New: func() any { return new(recvBuf) }}

// getStreamed reads key's record (its cluster key rkey) into dst by a
// streamed GET, falling back to a pipelined one on a failure other than an
// absent key while ctx lasts. It counts the outcome like fill.
func (s *Store) getStreamed(ctx context.Context, client rueidis.Client, rkey string, key [16]byte, dst []byte) bool {
	w := recvBufs.Get().(*recvBuf)
	defer recvBufs.Put(w)
	w.reset(record.HeaderSize + len(dst))
	st := client.DoStream(ctx, client.B().Get().Key(rkey).Build())
	_, err := st.WriteTo(w)
	switch {
	case rueidis.IsRedisNil(err):
		s.notFound.Add(1)
		return false
	case err != nil && ctx.Err() == nil:
		return s.fill(client.Do(ctx, client.B().Get().Key(rkey).Build()), key, dst)
	case err != nil:
		s.countMiss(err)
		return false
	case w.over || w.n < record.HeaderSize:
		s.corrupt.Add(1)
		return false
	}
	h, err := record.DecodeHeader(w.buf[:w.n])
	switch {
	case err != nil:
		s.corrupt.Add(1)
		return false
	case h.Check(s.cfg.Fingerprint, record.HostLayoutVersion) != nil || h.Key != key:
		s.stale.Add(1)
		return false
	case h.PayloadLen != uint64(len(dst)) || w.n != len(w.buf) || w.sum != h.PayloadSum:
		s.corrupt.Add(1)
		return false
	}
	copy(dst, w.buf[record.HeaderSize:w.n])
	s.hits.Add(1)
	s.hitBytes.Add(int64(len(dst)))
	return true
}
