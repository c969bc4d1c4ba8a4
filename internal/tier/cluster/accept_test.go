package cluster

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/tier/record"
)

const judgeFP = 0x0123456789abcdef

// validRecord is key's record of payload under judgeFP.
func validRecord(key [16]byte, payload []byte) []byte {
	v := make([]byte, record.HeaderSize+len(payload))
	record.EncodeHeader(v, record.Header{LayoutVersion: record.HostLayoutVersion, Fingerprint: judgeFP, Key: key,
		PayloadLen: uint64(len(payload)), PayloadSum: record.Checksum(payload)})
	copy(v[record.HeaderSize:], payload)
	return v
}

// verdict is how Store.count files a reply: a hit, stale or corrupt.
type verdict uint8

const (
	accepted verdict = iota
	corrupt
	stale
)

func verdictOf(err error) verdict {
	switch {
	case err == nil:
		return accepted
	case record.Stale(err):
		return stale
	}
	return corrupt
}

// judgeWhole is fill's decision on a reply held whole.
func judgeWhole(v []byte, key [16]byte, n int) verdict {
	return verdictOf(record.Accept(v, len(v), func() uint32 { return record.Checksum(v[record.HeaderSize:]) }, judgeFP, key, n))
}

// judgeStreamed is getStreamed's decision on the same reply, received in
// pieces of chunk bytes by a recvBuf.
func judgeStreamed(t *testing.T, v []byte, key [16]byte, n, chunk int) verdict {
	w := new(recvBuf)
	w.reset(n, nil)
	_, err := w.ReadFrom(&chunkReader{data: v, n: chunk})
	require.NoError(t, err)
	if w.over {
		return corrupt
	}
	return verdictOf(record.Accept(w.hdr, w.n, func() uint32 { return w.sum }, judgeFP, key, n))
}

// TestJudge: the accept decision (record.Accept) is the same on a reply
// held whole (fill) and received in pieces (getStreamed): a record of the
// key, fingerprint and length wanted is accepted; one byte changed anywhere
// a reader looks makes it corrupt or stale, never accepted; so does any
// other length. FuzzAccept (internal/tier/record) covers the decision itself.
func TestJudge(t *testing.T) {
	key := [16]byte{1, 2, 3}
	payload := bytes.Repeat([]byte{0x5A, 0xA5, 7}, 1000)
	v := validRecord(key, payload)
	require.Equal(t, accepted, judgeWhole(v, key, len(payload)))
	require.Equal(t, accepted, judgeStreamed(t, v, key, len(payload), 1000))
	require.Equal(t, stale, judgeWhole(v, [16]byte{1, 2, 4}, len(payload)), "another key")
	other := make([]byte, len(v))
	copy(other, v)
	record.EncodeHeader(other, record.Header{LayoutVersion: record.HostLayoutVersion, Fingerprint: judgeFP + 1, Key: key,
		PayloadLen: uint64(len(payload)), PayloadSum: record.Checksum(payload)})
	require.Equal(t, stale, judgeWhole(other, key, len(payload)), "another fingerprint")
	require.Equal(t, corrupt, judgeWhole(v, key, len(payload)-1), "another length wanted")
	require.Equal(t, corrupt, judgeWhole(v[:len(v)-1], key, len(payload)), "cut short")
	require.Equal(t, corrupt, judgeWhole(append(append([]byte(nil), v...), 0), key, len(payload)), "one byte more")
	require.Equal(t, corrupt, judgeStreamed(t, append(append([]byte(nil), v...), 0), key, len(payload), 4096), "one byte more, streamed")
	for _, i := range []int{0, 9, 13, 17, 25, 41, 49, 57, record.HeaderSize, len(v) - 1} {
		bad := append([]byte(nil), v...)
		bad[i] ^= 0x10
		require.NotEqual(t, accepted, judgeWhole(bad, key, len(payload)), "byte %d flipped", i)
		require.NotEqual(t, accepted, judgeStreamed(t, bad, key, len(payload), 777), "byte %d flipped, streamed", i)
	}
}
