package cluster

import (
	"bytes"
	"context"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The slot map read at connect names the master that holds each key, and
// shares Streams out among the masters.
func TestSlotMap(t *testing.T) {
	c := shared(t)
	s := open(t, c, Config{Namespace: "slotmap", Streams: 7, Timeout: 5 * time.Second})
	m := s.slots.Load()
	require.NotNil(t, m, "no slot map after connect")
	require.Len(t, m.addrs, 3)
	for _, sem := range m.sems {
		require.Equal(t, 3, cap(sem), "7 streams over 3 masters, rounded up")
	}
	const n, size = 30, 1000
	ks, ps := keysN(n, 0x31), payloads(n, size)
	putAll(t, s, ks, ps)
	seen := map[string]bool{}
	for _, k := range ks {
		rk := s.key(s.gen.Load(), k)
		owner := m.owner[keySlot(rk)]
		require.NotEqual(t, noMaster, int(owner), "slot of %s has no master", rk)
		_, port, err := net.SplitHostPort(m.addrs[owner])
		require.NoError(t, err)
		p, err := strconv.Atoi(port)
		require.NoError(t, err)
		out, err := c.cli(p, "exists", rk)
		require.NoError(t, err)
		require.Equal(t, "1", out, "the map's master %s does not hold %s", m.addrs[owner], rk)
		seen[m.addrs[owner]] = true
	}
	require.Len(t, seen, 3, "30 keys all on fewer than 3 masters")
}

// A map that names the wrong masters costs balance, never a record: the
// client routes each GET itself. One stream a master still reads every key.
func TestGetWithWrongSlotMap(t *testing.T) {
	c := shared(t)
	s := open(t, c, Config{Namespace: "wrongmap", Streams: 3, GenerationRefresh: -1, Timeout: 5 * time.Second})
	const n, size = 60, 3000
	ks, ps := keysN(n, 0x32), payloads(n, size)
	putAll(t, s, ks, ps)
	m := s.slots.Load()
	require.NotNil(t, m)
	wrong := &slotMap{sems: m.sems, addrs: m.addrs}
	for i := range wrong.owner {
		wrong.owner[i] = uint8((int(m.owner[i]) + 1) % len(m.sems))
	}
	wrong.owner[keySlot(s.key(s.gen.Load(), ks[0]))] = noMaster
	s.slots.Store(wrong)
	for _, direct := range []bool{false, true} {
		ds := dstsN(n, size)
		ok := s.get(context.Background(), ks, ds, direct)
		require.Equal(t, n, count(ok), "direct %v", direct)
		for i := range ks {
			require.True(t, bytes.Equal(ps[i], ds[i]), "key %d, direct %v", i, direct)
		}
	}
	require.Len(t, s.streams, 0, "a stream left taken")
	for _, sem := range m.sems {
		require.Len(t, sem, 0, "a master's stream left taken")
	}
}

// A Get whose masters' streams are all taken waits no longer than its
// deadline: every key a timeout, counted, nothing left taken.
func TestGetWaitsForMasterStreams(t *testing.T) {
	c := shared(t)
	s := open(t, c, Config{Namespace: "busymasters", Streams: 3, GenerationRefresh: -1, Timeout: 5 * time.Second})
	const n, size = 12, 100
	ks, ps := keysN(n, 0x33), payloads(n, size)
	putAll(t, s, ks, ps)
	m := s.slots.Load()
	require.NotNil(t, m)
	for _, sem := range m.sems {
		for range cap(sem) {
			sem <- struct{}{}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	ok := s.GetDirect(ctx, ks, dstsN(n, size))
	require.Less(t, time.Since(start), 3*time.Second)
	require.Zero(t, count(ok))
	require.EqualValues(t, n, s.Stats().Timeouts)
	require.Len(t, s.streams, 0)
	for _, sem := range m.sems {
		for range cap(sem) {
			<-sem
		}
	}
	// The store's streams all taken: a key that got its master's place
	// gives it back when its deadline comes first.
	for range cap(s.streams) {
		s.streams <- struct{}{}
	}
	ctx2, cancel2 := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel2()
	require.Zero(t, count(s.Get(ctx2, ks, dstsN(n, size))))
	require.EqualValues(t, 2*n, s.Stats().Timeouts)
	for _, sem := range m.sems {
		require.Len(t, sem, 0, "a master's place left taken")
	}
	for range cap(s.streams) {
		<-s.streams
	}
	ds := dstsN(n, size)
	require.Equal(t, n, count(s.Get(context.Background(), ks, ds)))
	for i := range ks {
		require.True(t, bytes.Equal(ps[i], ds[i]), "key %d", i)
	}
}

// buildSlotMap on any ranges: no panic; on success every slot of a range
// is owned by the last range naming it and no other slot has a master,
// one semaphore a master with Streams shared out; on an error no map.
func FuzzBuildSlotMap(f *testing.F) {
	f.Add([]byte{0, 0, 0x15, 0x54, 1, 0x15, 0x55, 0x2a, 0xaa, 2, 0x2a, 0xab, 0x3f, 0xff, 3}, uint8(32))
	f.Add([]byte{0x3f, 0xff, 0, 0, 1}, uint8(0))
	f.Add([]byte{0x40, 0, 0x40, 0, 1}, uint8(7))
	f.Fuzz(func(t *testing.T, b []byte, streams uint8) {
		var rs []slotRange
		for len(b) >= 5 && len(rs) < 600 {
			// Signed 16-bit slot numbers, so negatives and > 16383 occur.
			first := int64(int16(uint16(b[0])<<8 | uint16(b[1])))
			last := int64(int16(uint16(b[2])<<8 | uint16(b[3])))
			n := "n" + strconv.Itoa(int(b[4])%300)
			rs = append(rs, slotRange{first, last, n, n + ":1"})
			b = b[5:]
		}
		s := &Store{cfg: Config{Streams: int(streams)}}
		m, err := s.buildSlotMap(rs)
		if err != nil {
			require.Nil(t, m)
			return
		}
		want := map[int]string{}
		for _, r := range rs {
			for slot := r.first; slot <= r.last; slot++ {
				want[int(slot)] = r.addr
			}
		}
		for slot, o := range m.owner {
			if a, ok := want[slot]; ok {
				require.Less(t, int(o), len(m.addrs), "slot %d", slot)
				require.Equal(t, a, m.addrs[o], "slot %d", slot)
			} else {
				require.Equal(t, noMaster, int(o), "slot %d", slot)
			}
		}
		require.Len(t, m.sems, len(m.addrs))
		for _, sem := range m.sems {
			require.Equal(t, max(1, (int(streams)+len(m.addrs)-1)/max(1, len(m.addrs))), cap(sem))
		}
	})
}
