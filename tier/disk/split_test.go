package disk

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/tier/record"
)

// TestSplitReads: Get's split read (the header and the head, then the
// tail while the head is checksummed) gives every record back byte for
// byte, into an aligned buffer and through the bounce buffer, and a byte
// flipped in the head, in the tail or in the header is a miss counted
// Corrupt, the other records unharmed. (c1fdfc1 also tried the tail's read
// in flight with the head's: slower on the H200 machine's disk, 1.05
// against 1.29 GB/s, bench/results/h200/disk/disk-q1-c1fdfc1.txt.)
func TestSplitReads(t *testing.T) {
	saved := splitMinBytes
	t.Cleanup(func() { splitMinBytes = saved })
	splitMinBytes = align // records of 64 KiB split: an 8 KiB tail
	for _, size := range []int64{16 * align, 64 * align} {
		t.Run(fmt.Sprintf("payload=%d", size), func(t *testing.T) {
			s := open(t, config(directDir(t), size, 8))
			require.NotZero(t, s.readTail(s.dirs[0]), "the reads are split")
			for i := range 6 {
				require.NoError(t, s.Put(key(i), payload(key(i), size)))
			}
			for i := range 6 {
				mustGet(t, s, key(i))
			}
			odd := make([]byte, size+1)[1:] // unaligned: through the bounce buffer
			ok, err := s.Get(key(0), odd)
			require.NoError(t, err)
			require.True(t, ok)
			require.Equal(t, payload(key(0), size), odd)

			path := s.dirs[0].path
			flip := func(k [16]byte, at int64) {
				off := slotOff(t, s, k) + at
				patch(t, path, off, []byte{readAt(t, path, off, 1)[0] ^ 0x40})
			}
			flip(key(1), record.HeaderSize+size-5) // in the tail
			flip(key(2), record.HeaderSize+7)      // in the head
			flip(key(3), 30)                       // in the header
			for n, k := range [][16]byte{key(1), key(2), key(3)} {
				mustMiss(t, s, k)
				require.Equal(t, int64(n+1), s.Stats().Corrupt)
				require.False(t, s.Contains(k), "dropped")
			}
			for _, i := range []int{0, 4, 5} {
				mustGet(t, s, key(i))
			}
			require.Zero(t, s.Stats().IOErrors)
		})
	}
}
