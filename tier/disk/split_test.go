package disk

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/tier/record"
)

// TestSplitReads: Get's split read (the header and the head, then the
// tail; or with splitParallel both in flight) gives every record back
// byte for byte, into an aligned buffer and through the bounce buffer,
// and a byte flipped in the head, in the tail or in the header is a miss
// counted Corrupt, the other records unharmed.
func TestSplitReads(t *testing.T) {
	savedMin, savedPar := splitMinBytes, splitParallel
	t.Cleanup(func() { splitMinBytes, splitParallel = savedMin, savedPar })
	splitMinBytes = align // records of 64 KiB split: an 8 KiB tail
	for _, par := range []bool{false, true} {
		t.Run(fmt.Sprintf("parallel=%v", par), func(t *testing.T) {
			splitParallel = par
			const size = 16 * align
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
