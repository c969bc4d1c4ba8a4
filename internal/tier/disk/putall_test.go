package disk

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestPutAll: every block the store lacks is written (one it holds and
// one without memory skipped); with ctx ended before, none is; with ctx
// ending in the first write, no write starts after it: at most one per
// writer ran, and written + left covers every block.
func TestPutAll(t *testing.T) {
	const n, size = 12, 2 * align
	mems := make([][]byte, n)
	for i := range n {
		mems[i] = payload(key(i), size)
	}
	mems[5] = nil
	keyOf := func(i int) [16]byte { return key(i) }
	memOf := func(i int) []byte { return mems[i] }

	s := open(t, config(directDir(t), size, 2*n))
	require.NoError(t, s.Put(key(3), mems[3]))
	written, failed, left := s.PutAll(context.Background(), n, 2, keyOf, memOf, nil)
	require.Equal(t, [3]int64{n - 2, 0, 0}, [3]int64{written, failed, left})
	for i := range n {
		require.Equal(t, i != 5, s.Contains(key(i)), "block %d", i)
		if i != 5 {
			mustGet(t, s, key(i))
		}
	}

	ended, cancel := context.WithCancel(context.Background())
	cancel()
	s = open(t, config(directDir(t), size, 2*n))
	written, failed, left = s.PutAll(ended, n, 2, keyOf, memOf, nil)
	require.Equal(t, [3]int64{0, 0, n - 1}, [3]int64{written, failed, left}, "ctx ended: nothing started")

	for _, writers := range []int{1, 3} {
		ctx, cancel := context.WithCancel(context.Background())
		s = open(t, config(directDir(t), size, 2*n))
		written, failed, left = s.PutAll(ctx, n, writers, keyOf, memOf, func(int) { cancel() })
		require.Zero(t, failed)
		require.LessOrEqual(t, written, int64(writers), "writers %d: only the writes already past their check", writers)
		require.Positive(t, written)
		require.Equal(t, int64(n-1), written+left, "writers %d: every block with memory written or left", writers)
	}
}
