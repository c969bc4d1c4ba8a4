package cluster

import (
	"bytes"
	"hash/crc32"
	"io"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/tier/record"
)

// chunkReader hands out its data in pieces of at most n bytes.
type chunkReader struct {
	data []byte
	n    int
}

func (r *chunkReader) Read(p []byte) (int, error) {
	if len(r.data) == 0 {
		return 0, io.EOF
	}
	m := copy(p[:min(len(p), r.n)], r.data)
	r.data = r.data[m:]
	return m, nil
}

// FuzzRecvBuf: a reply of any length, arriving in pieces of any size (or
// whole, through Write), lands header first, then payload, in the pooled
// buffer or the caller's; a longer reply is drained and marked over; the
// checksum covers exactly the payload bytes received.
func FuzzRecvBuf(f *testing.F) {
	f.Add([]byte("short"), 3, 10, false, false)
	f.Add(bytes.Repeat([]byte{7}, record.HeaderSize+10), 4096, 10, true, false)
	f.Add(bytes.Repeat([]byte{9}, record.HeaderSize+20), 1000, 10, false, true)
	f.Fuzz(fuzzRecvBufBody)
}

func fuzzRecvBufBody(t *testing.T, data []byte, chunk, payload int, direct, whole bool) {
	if chunk <= 0 || payload < 0 || payload > 1<<16 || len(data) > 1<<17 {
		return
	}
	w := new(recvBuf)
	var dst []byte
	if direct {
		dst = bytes.Repeat([]byte{0xEE}, payload)
		w.reset(payload, dst)
	} else {
		w.reset(payload, nil)
	}
	if whole {
		n, err := w.Write(data)
		require.NoError(t, err)
		require.Equal(t, len(data), n)
	} else {
		n, err := w.ReadFrom(&chunkReader{data: data, n: chunk})
		require.NoError(t, err)
		require.EqualValues(t, len(data), n)
	}
	got := min(len(data), record.HeaderSize+payload)
	require.Equal(t, got, w.n)
	require.Equal(t, len(data) > record.HeaderSize+payload, w.over)
	h := min(got, record.HeaderSize)
	require.True(t, bytes.Equal(data[:h], w.hdr[:h]), "header")
	body := data[h:got]
	require.True(t, bytes.Equal(body, w.body[:len(body)]), "payload")
	require.Equal(t, crc32.Checksum(body, castagnoli), w.sum)
	if direct {
		require.True(t, bytes.Equal(body, dst[:len(body)]), "received into the destination")
		require.True(t, bytes.Equal(bytes.Repeat([]byte{0xEE}, payload-len(body)), dst[len(body):]), "nothing past what came")
	}
	w.release()
	require.Nil(t, w.body, "no reference to the caller's buffer is pooled")
}
