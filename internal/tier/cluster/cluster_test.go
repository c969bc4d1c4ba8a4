package cluster

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/rueidis"
	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/tier/record"
)

var nsSeq atomic.Int64

// open opens a store on c with a namespace of its own unless cfg names one.
func open(t *testing.T, c *testCluster, cfg Config) *Store {
	t.Helper()
	cfg.Addrs = c.addrs()
	if cfg.Password == "" {
		cfg.Password = c.password
	}
	if cfg.Namespace == "" {
		cfg.Namespace = t.Name() + "-" + strconv.FormatInt(nsSeq.Add(1), 10)
	}
	if cfg.Fingerprint == 0 {
		cfg.Fingerprint = 0xfeedface
	}
	s, err := Open(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s
}

func keysN(n int, seed byte) [][16]byte {
	ks := make([][16]byte, n)
	for i := range ks {
		ks[i][0] = seed
		ks[i][8] = byte(i >> 8)
		ks[i][15] = byte(i)
	}
	return ks
}

func payloads(n, size int) [][]byte {
	ps := make([][]byte, n)
	for i := range ps {
		ps[i] = make([]byte, size)
		rand.Read(ps[i])
	}
	return ps
}

func dstsN(n, size int) [][]byte {
	ds := make([][]byte, n)
	for i := range ds {
		ds[i] = bytes.Repeat([]byte{0xAA}, size)
	}
	return ds
}

func putAll(t *testing.T, s *Store, ks [][16]byte, ps [][]byte) {
	t.Helper()
	for i := range ks {
		require.True(t, s.PutAsync(ks[i], ps[i]))
	}
	s.Flush()
}

func count(ok []bool) (n int) {
	for _, b := range ok {
		if b {
			n++
		}
	}
	return n
}

func TestRoundTrip(t *testing.T) {
	c := shared(t)
	var done atomic.Int64
	s := open(t, c, Config{OnPutDone: func(_ [16]byte, ok bool) {
		// A slow callback: Flush (in putAll) must still wait for it.
		time.Sleep(2 * time.Millisecond)
		if ok {
			done.Add(1)
		}
	}})
	const n, size = 300, 8<<10 + 17
	ks, ps := keysN(n, 1), payloads(n, size)
	putAll(t, s, ks, ps)
	require.EqualValues(t, n, done.Load(), "Flush returned before every OnPutDone had")
	st := s.Stats()
	require.EqualValues(t, n, st.Puts)
	require.Zero(t, st.InFlightBytes)

	ds := dstsN(n, size)
	ok := s.Get(context.Background(), ks, ds)
	require.Equal(t, n, count(ok))
	for i := range ks {
		require.True(t, bytes.Equal(ps[i], ds[i]), "key %d", i)
	}
	// Every master holds some of them.
	for _, p := range c.ports[:3] {
		out, err := c.cli(p, "dbsize")
		require.NoError(t, err)
		nk, _ := strconv.Atoi(out)
		require.Greater(t, nk, 10, "master %d holds %s keys", p, out)
	}
	// Absent keys are misses, counted, their destinations untouched.
	ds = dstsN(5, size)
	ok = s.Get(context.Background(), keysN(5, 2), ds)
	require.Zero(t, count(ok))
	require.Equal(t, dstsN(5, size), ds)
	st = s.Stats()
	require.EqualValues(t, n, st.Hits)
	require.EqualValues(t, 5, st.NotFound)
	require.EqualValues(t, 5, st.Misses)
	require.NoError(t, s.Close())
	require.False(t, s.PutAsync(ks[0], ps[0]))
	require.Zero(t, count(s.Get(context.Background(), ks[:2], ds[:2])))
	require.EqualValues(t, 1, s.Stats().Dropped)
	require.EqualValues(t, 2, s.Stats().Errors)
}

// TestPutFromOnPutDone: with room for one record in flight, each
// OnPutDone puts the next record: the room of the put that completed is
// free by then, so none is dropped, and Flush returns after the last
// callback (which put nothing more).
func TestPutFromOnPutDone(t *testing.T) {
	c := shared(t)
	const n, size = 20, 4 << 10
	ks, ps := keysN(n, 9), payloads(n, size)
	var s *Store
	var next, dropped atomic.Int64
	s = open(t, c, Config{MaxInFlightBytes: record.HeaderSize + size, OnPutDone: func(_ [16]byte, ok bool) {
		if i := next.Add(1); i < n && !s.PutAsync(ks[i], ps[i]) {
			dropped.Add(1)
		}
	}})
	require.True(t, s.PutAsync(ks[0], ps[0]))
	require.Eventually(t, func() bool { return next.Load() >= n }, 10*time.Second, time.Millisecond, "the chain of puts from OnPutDone stopped")
	s.Flush()
	require.Zero(t, dropped.Load(), "a put from OnPutDone found the completed put's bytes still in flight")
	require.EqualValues(t, n, s.Stats().Puts)
	ds := dstsN(n, size)
	require.Equal(t, n, count(s.Get(context.Background(), ks, ds)))
	require.Equal(t, ps, ds)
}

func TestKeyFormat(t *testing.T) {
	c := shared(t)
	s := open(t, c, Config{Prefix: "px", Namespace: "nsA"})
	k := keysN(1, 3)[0]
	putAll(t, s, [][16]byte{k}, payloads(1, 10))
	out, err := c.cli(c.ports[0], "-c", "exists", "px:nsA:0:"+hex.EncodeToString(k[:]))
	require.NoError(t, err)
	require.Equal(t, "1", out)
}

func TestClearByGeneration(t *testing.T) {
	c := shared(t)
	s := open(t, c, Config{})
	other := open(t, c, Config{Namespace: s.cfg.Namespace, GenerationRefresh: 50 * time.Millisecond})
	const n, size = 50, 1000
	ks, ps := keysN(n, 4), payloads(n, size)
	putAll(t, s, ks, ps)
	require.Equal(t, n, count(other.Get(context.Background(), ks, dstsN(n, size))))

	require.NoError(t, s.Clear(context.Background()))
	require.EqualValues(t, 1, s.Stats().Generation)
	require.Zero(t, count(s.Get(context.Background(), ks, dstsN(n, size))), "unreachable at once")
	require.Eventually(t, func() bool { return other.Stats().Generation == 1 }, 2*time.Second, 10*time.Millisecond)
	require.Zero(t, count(other.Get(context.Background(), ks, dstsN(n, size))))
	out, err := c.cli(c.ports[0], "-c", "get", DefaultPrefix+":"+s.cfg.Namespace+":gen")
	require.NoError(t, err)
	require.Equal(t, "1", out)

	// New records land in the new generation; the old ones keep their TTL.
	putAll(t, s, ks[:10], ps[:10])
	require.Equal(t, 10, count(other.Get(context.Background(), ks[:10], dstsN(10, size))))
	out, err = c.cli(c.ports[0], "-c", "pttl", s.key(0, ks[20]))
	require.NoError(t, err)
	ms, _ := strconv.Atoi(out)
	require.Greater(t, ms, 0)

	// A lost generation key never takes a store back.
	_, err = c.cli(c.ports[0], "-c", "del", s.genKey)
	require.NoError(t, err)
	require.NoError(t, s.Clear(context.Background()))
	require.EqualValues(t, 2, s.Stats().Generation)
}

func TestTTL(t *testing.T) {
	c := shared(t)
	s := open(t, c, Config{TTL: 300 * time.Millisecond})
	ks, ps := keysN(20, 5), payloads(20, 100)
	putAll(t, s, ks, ps)
	out, err := c.cli(c.ports[0], "-c", "pttl", s.key(0, ks[0]))
	require.NoError(t, err)
	ms, _ := strconv.Atoi(out)
	require.True(t, ms > 0 && ms <= 300, "pttl %s", out)
	require.Equal(t, 20, count(s.Get(context.Background(), ks, dstsN(20, 100))))
	time.Sleep(450 * time.Millisecond)
	require.Zero(t, count(s.Get(context.Background(), ks, dstsN(20, 100))))
	require.EqualValues(t, 20, s.Stats().NotFound)
}

func TestBadRecords(t *testing.T) {
	c := shared(t)
	s := open(t, c, Config{Fingerprint: 1})
	wrongFP := open(t, c, Config{Namespace: s.cfg.Namespace, Fingerprint: 2})
	const size = 4096 + 3
	ks, ps := keysN(6, 6), payloads(6, size)
	putAll(t, s, ks[:1], ps[:1])

	// A record of another fingerprint.
	ds := dstsN(1, size)
	require.False(t, wrongFP.Get(context.Background(), ks[:1], ds)[0])
	require.Equal(t, dstsN(1, size), ds)
	require.EqualValues(t, 1, wrongFP.Stats().Stale)

	set := func(k [16]byte, v []byte) {
		require.NoError(t, s.cl().Do(context.Background(),
			s.cl().B().Set().Key(s.key(0, k)).Value(rueidis.BinaryString(v)).Build()).Error())
	}
	rec := func(k [16]byte, p []byte) []byte {
		b := make([]byte, record.HeaderSize+len(p))
		record.EncodeHeader(b, record.Header{LayoutVersion: record.HostLayoutVersion, Fingerprint: 1,
			Key: k, PayloadLen: uint64(len(p)), PayloadSum: record.Checksum(p)})
		copy(b[record.HeaderSize:], p)
		return b
	}
	set(ks[1], rec(ks[1], ps[1])) // valid, written by hand
	set(ks[2], []byte("garbage")) // not a record
	flipped := rec(ks[3], ps[3])  // payload corrupted
	flipped[len(flipped)-1] ^= 1
	set(ks[3], flipped)
	set(ks[4], rec(ks[1], ps[1])) // ks[1]'s record under ks[4]
	short := rec(ks[5], ps[5])    // cut short
	set(ks[5], short[:len(short)-1])
	ds = dstsN(5, size)
	ok := s.Get(context.Background(), ks[1:], ds)
	require.Equal(t, []bool{true, false, false, false, false}, ok)
	require.Equal(t, ps[1], ds[0])
	require.Equal(t, dstsN(4, size), ds[1:], "misses leave destinations untouched")
	st := s.Stats()
	require.EqualValues(t, 3, st.Corrupt)
	require.EqualValues(t, 1, st.Stale)
	require.EqualValues(t, 4, st.Misses)

	// A destination of another size than the record's payload.
	require.False(t, s.Get(context.Background(), ks[1:2], dstsN(1, size+1))[0])
	require.EqualValues(t, 4, s.Stats().Corrupt)

	// GetDirect: the same answers and counts (its misses' destinations
	// may hold anything).
	ds = dstsN(5, size)
	ok = s.GetDirect(context.Background(), ks[1:], ds)
	require.Equal(t, []bool{true, false, false, false, false}, ok)
	require.Equal(t, ps[1], ds[0])
	st = s.Stats()
	require.EqualValues(t, 4+3, st.Corrupt)
	require.EqualValues(t, 1+1, st.Stale)
	require.EqualValues(t, 4+4+1, st.Misses)
	require.False(t, s.GetDirect(context.Background(), ks[1:2], dstsN(1, size+1))[0])
	require.False(t, s.GetDirect(context.Background(), ks[1:2], dstsN(1, size-1))[0])
	require.EqualValues(t, 4+3+2, s.Stats().Corrupt)
	ds = dstsN(1, size)
	require.False(t, wrongFP.GetDirect(context.Background(), ks[:1], ds)[0])
	require.EqualValues(t, 2, wrongFP.Stats().Stale)
}

// PutAsyncFrom copies the payload before it calls release, once per put
// accepted and never for one dropped: a caller that reuses the payload in
// release (as the engine gives its pool slot back) still stores the bytes
// it passed.
func TestPutAsyncFrom(t *testing.T) {
	c := shared(t)
	s := open(t, c, Config{MaxInFlightBytes: 4 * (record.HeaderSize + 300<<10)})
	const n, size = 40, 300 << 10 // from 256 KiB: CopyChecksum in pieces where GOMAXPROCS allows
	ks, ps := keysN(n, 11), payloads(n, size)
	want := make([][]byte, n)
	for i := range ps {
		want[i] = bytes.Clone(ps[i])
	}
	var released [n]atomic.Int32
	var dropped []int
	for i := range ks {
		if !s.PutAsyncFrom(ks[i], ps[i], func() {
			released[i].Add(1)
			for j := range ps[i] {
				ps[i][j] ^= 0x5a // the slot reused at once
			}
		}) {
			dropped = append(dropped, i)
		}
	}
	s.Flush()
	require.EqualValues(t, len(dropped), s.Stats().Dropped)
	ds := dstsN(n, size)
	ok := s.Get(context.Background(), ks, ds)
	for i := range ks {
		if slices.Contains(dropped, i) {
			require.Zero(t, released[i].Load(), "key %d: dropped, yet released", i)
			require.False(t, ok[i])
			continue
		}
		require.EqualValues(t, 1, released[i].Load(), "key %d: released once", i)
		require.True(t, ok[i], "key %d", i)
		require.True(t, bytes.Equal(want[i], ds[i]), "key %d: the bytes passed, not those after release", i)
	}
	require.Less(t, len(dropped), n, "some put was accepted")
	require.NoError(t, s.Close())
	called := false
	require.False(t, s.PutAsyncFrom(ks[0], want[0], func() { called = true }))
	require.False(t, called, "a put refused after Close is not released")
}

func TestBoundedInFlight(t *testing.T) {
	c := shared(t)
	release := make(chan struct{})
	s := open(t, c, Config{MaxInFlightBytes: 3 * (record.HeaderSize + 1000),
		faults: &faults{fn: func(op faultOp) error {
			if op == opPut {
				<-release
			}
			return nil
		}}})
	ks, ps := keysN(5, 7), payloads(5, 1000)
	for i := range 3 {
		require.True(t, s.PutAsync(ks[i], ps[i]))
		ps[i][0]++ // the caller's buffer is free at once
	}
	require.False(t, s.PutAsync(ks[3], ps[3]))
	st := s.Stats()
	require.EqualValues(t, 1, st.Dropped)
	require.EqualValues(t, 3*(record.HeaderSize+1000), st.InFlightBytes)
	require.EqualValues(t, 3, st.InFlightPuts)
	close(release)
	s.Flush()
	require.True(t, s.PutAsync(ks[3], ps[3]))
	s.Flush()
	ds := dstsN(4, 1000)
	require.Equal(t, 4, count(s.Get(context.Background(), ks[:4], ds)))
	for i := range 3 {
		ps[i][0]--
		require.Equal(t, ps[i], ds[i])
	}
	require.EqualValues(t, 4, s.Stats().Puts)
}

func TestTimeouts(t *testing.T) {
	c := shared(t)
	s := open(t, c, Config{Timeout: 200 * time.Millisecond})
	const n = 60
	ks, ps := keysN(n, 8), payloads(n, 100)
	putAll(t, s, ks, ps)
	// One master stops answering for a second.
	slept := make(chan struct{})
	go func() {
		defer close(slept)
		c.cli(c.ports[1], "debug", "sleep", "1")
	}()
	time.Sleep(100 * time.Millisecond)
	start := time.Now()
	ok := s.Get(context.Background(), ks, dstsN(n, 100))
	require.Less(t, time.Since(start), 600*time.Millisecond)
	hits := count(ok)
	require.Greater(t, hits, 0)
	require.Less(t, hits, n)
	st := s.Stats()
	require.EqualValues(t, n-hits, st.Timeouts+st.Errors)
	require.Greater(t, st.Timeouts, int64(0))
	// A put to it times out too: a failed put, counted.
	s.PutAsync(ks[0], ps[0])
	<-slept
	s.Flush()
	// A context already past its deadline: all misses.
	ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	require.Zero(t, count(s.Get(ctx, ks, dstsN(n, 100))))
	// The fault seam's errors are counted the same way.
	s.cfg.faults = &faults{fn: func(faultOp) error { return errors.New("injected") }}
	require.Zero(t, count(s.Get(context.Background(), ks[:3], dstsN(3, 100))))
	require.True(t, s.PutAsync(ks[0], ps[0]))
	s.Flush()
	require.GreaterOrEqual(t, s.Stats().PutErrors, int64(1))
	require.Equal(t, s.Stats().Misses, s.Stats().NotFound+s.Stats().Timeouts+s.Stats().Errors)
}

func TestFullClusterOOM(t *testing.T) {
	c := shared(t)
	s := open(t, c, Config{})
	for _, p := range c.ports[:3] {
		_, err := c.cli(p, "config", "set", "maxmemory-policy", "noeviction")
		require.NoError(t, err)
		_, err = c.cli(p, "config", "set", "maxmemory", "1")
		require.NoError(t, err)
	}
	t.Cleanup(func() {
		for _, p := range c.ports[:3] {
			c.cli(p, "config", "set", "maxmemory", "0")
		}
	})
	ks, ps := keysN(10, 9), payloads(10, 1000)
	putAll(t, s, ks, ps)
	st := s.Stats()
	require.EqualValues(t, 10, st.PutErrors)
	require.EqualValues(t, 10, st.PutOOM)
	require.Zero(t, count(s.Get(context.Background(), ks, dstsN(10, 1000))))
}

func TestConfig(t *testing.T) {
	for _, cfg := range []Config{
		{},
		{Addrs: []string{"x:1"}},
		{Addrs: []string{"x:1"}, Namespace: "n", TTL: time.Microsecond},
		{Addrs: []string{"x:1"}, Namespace: "n", ConnsPerNode: 3},
		{Addrs: []string{"x:1"}, Namespace: "n", MaxInFlightBytes: -1},
	} {
		_, err := Open(context.Background(), cfg)
		require.ErrorIs(t, err, ErrConfig)
	}
}

// TestAuthAndFailover: a cluster of 3 masters and 3 replicas with
// requirepass and masterauth; a master killed mid-run gives misses, then hits
// again once its replica is promoted.
func TestAuthAndFailover(t *testing.T) {
	c := newCluster(t, 3, 1, "s3cret")
	_, err := Open(context.Background(), Config{Addrs: c.addrs(), Namespace: "n", Timeout: 500 * time.Millisecond})
	require.Error(t, err, "no AUTH")
	_, err = Open(context.Background(), Config{Addrs: c.addrs(), Namespace: "n", Password: "wrong", Timeout: 500 * time.Millisecond})
	require.Error(t, err, "wrong password")
	// An ACL user.
	for _, p := range c.ports {
		_, err := c.cli(p, "acl", "setuser", "kvo", "on", ">userpw", "~*", "+@all")
		require.NoError(t, err)
	}
	u := open(t, c, Config{Username: "kvo", Password: "userpw"})
	putAll(t, u, keysN(3, 10), payloads(3, 10))
	require.EqualValues(t, 3, u.Stats().Puts)

	s := open(t, c, Config{Timeout: 300 * time.Millisecond})
	const n, size = 150, 2000
	ks, ps := keysN(n, 11), payloads(n, size)
	putAll(t, s, ks, ps)
	require.EqualValues(t, n, s.Stats().Puts)
	waitReplicated(t, c)

	c.kill(c.ports[0])
	ok := s.Get(context.Background(), ks, dstsN(n, size))
	hits := count(ok)
	require.Less(t, hits, n, "the dead master's keys are misses")
	require.Greater(t, hits, 0)
	st := s.Stats()
	require.EqualValues(t, n-hits, st.Timeouts+st.Errors)

	var ds [][]byte
	require.Eventually(t, func() bool {
		ds = dstsN(n, size)
		return count(s.Get(context.Background(), ks, ds)) == n
	}, 20*time.Second, 100*time.Millisecond, "a replica is promoted")
	for i := range ks {
		require.Equal(t, ps[i], ds[i])
	}
	putAll(t, s, keysN(20, 12), payloads(20, 10))
	require.EqualValues(t, n+20, s.Stats().Puts)
}

// waitReplicated waits until every write is on the replicas (WAIT counts
// only its own connection's writes, so compare each master's offset with
// its replica's instead).
func waitReplicated(t *testing.T, c *testCluster) {
	t.Helper()
	require.Eventually(t, func() bool {
		for _, p := range c.ports[:c.masters] {
			out, err := c.cli(p, "info", "replication")
			if err != nil || !strings.Contains(out, "connected_slaves:1") {
				return false
			}
			off := field(out, "master_repl_offset")
			if !strings.Contains(out, "offset="+off+",") {
				return false
			}
		}
		return true
	}, 10*time.Second, 20*time.Millisecond)
}

func field(info, name string) string {
	for _, l := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(l), name+":"); ok {
			return v
		}
	}
	return ""
}

// TestReshard moves slots between masters (MIGRATE: ASK while a slot moves,
// MOVED after) while Gets run: the client follows the redirections and every
// record stays a hit.
func TestReshard(t *testing.T) {
	c := shared(t)
	s := open(t, c, Config{})
	const n, size = 200, 3000
	ks, ps := keysN(n, 13), payloads(n, size)
	putAll(t, s, ks, ps)
	from, err := c.cli(c.ports[0], "cluster", "myid")
	require.NoError(t, err)
	to, err := c.cli(c.ports[1], "cluster", "myid")
	require.NoError(t, err)
	stop := make(chan struct{})
	var rounds, wrong atomic.Int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			ds := dstsN(n, size)
			ok := s.Get(context.Background(), ks, ds)
			for i := range ok {
				if ok[i] && !bytes.Equal(ds[i], ps[i]) {
					wrong.Add(1)
				}
			}
			rounds.Add(1)
		}
	}()
	out, err := c.cli(c.ports[0], "--cluster", "reshard", "127.0.0.1:"+strconv.Itoa(c.ports[0]),
		"--cluster-from", from, "--cluster-to", to, "--cluster-slots", "1000", "--cluster-yes")
	require.NoError(t, err, out)
	close(stop)
	<-done
	require.Zero(t, wrong.Load())
	require.Greater(t, rounds.Load(), int64(0))
	require.NoError(t, c.waitOK(10*time.Second))
	ds := dstsN(n, size)
	require.Equal(t, n, count(s.Get(context.Background(), ks, ds)))
	for i := range ks {
		require.Equal(t, ps[i], ds[i])
	}
	t.Logf("%d Get rounds during the reshard; %+v", rounds.Load(), s.Stats())
}

// TestGetStreamsRecords: Get streams each record into a pooled buffer, so
// reading a 256 KiB record allocates far less than the record (a pipelined
// GET allocates the whole reply: 256 KiB); a reply longer than the destination
// expects is a corrupt miss that leaves the connection usable.
func TestGetStreamsRecords(t *testing.T) {
	c := shared(t)
	s := open(t, c, Config{})
	const n, size = 8, 256<<10 - record.HeaderSize
	ks, ps := keysN(n, 50), payloads(n, size)
	putAll(t, s, ks, ps)
	ds := dstsN(n, size)
	require.Equal(t, n, count(s.Get(context.Background(), ks, ds))) // warm the pools
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	const rounds = 10
	for range rounds {
		require.Equal(t, n, count(s.Get(context.Background(), ks, ds)))
	}
	runtime.ReadMemStats(&after)
	perRecord := (after.TotalAlloc - before.TotalAlloc) / (rounds * n)
	t.Logf("%d bytes allocated per %d-byte record read", perRecord, size+record.HeaderSize)
	// A pipelined GET allocates the whole reply; a streamed one a few
	// hundred bytes, and under the race detector (whose sync.Pool drops a
	// quarter of what it is given) about a third of the record.
	require.Less(t, perRecord, uint64(size/2), "a record read allocates no reply of its own")
	require.Equal(t, ps, ds)

	short := dstsN(1, size-1)
	require.False(t, s.Get(context.Background(), ks[:1], short)[0])
	require.Equal(t, dstsN(1, size-1), short, "untouched")
	require.EqualValues(t, 1, s.Stats().Corrupt)
	ds = dstsN(n, size)
	require.Equal(t, n, count(s.Get(context.Background(), ks, ds)), "the stream's connection is still good")
	require.Equal(t, ps, ds)

	// GetDirect receives the payload into the destination: no payload
	// buffer of its own either.
	ds = dstsN(n, size)
	runtime.ReadMemStats(&before)
	for range rounds {
		clear(ds[0])
		require.Equal(t, n, count(s.GetDirect(context.Background(), ks, ds)))
	}
	runtime.ReadMemStats(&after)
	perRecord = (after.TotalAlloc - before.TotalAlloc) / (rounds * n)
	t.Logf("GetDirect: %d bytes allocated per record read", perRecord)
	require.Less(t, perRecord, uint64(size/2))
	require.Equal(t, ps, ds)
}
