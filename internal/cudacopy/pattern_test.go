package cudacopy

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
)

// The first two outputs of splitmix64 seeded with 0 (the published
// reference values) are mix64(0) and mix64(golden).
func TestMix64KnownAnswers(t *testing.T) {
	require.Equal(t, uint64(0xe220a8397b1dcdaf), mix64(0))
	require.Equal(t, uint64(0x6e789e6aa1b965f4), mix64(golden))
}

func TestFillPattern(t *testing.T) {
	b := make([]byte, 27)
	for i := range b {
		b[i] = 0xAA
	}
	FillPattern(golden-1, b)
	require.Equal(t, uint64(0x6e789e6aa1b965f4), binary.LittleEndian.Uint64(b[8:]), "word 1 is mix64(seed+1)")
	require.Equal(t, mix64(golden-1), binary.LittleEndian.Uint64(b[0:]))
	require.Equal(t, mix64(golden+1), binary.LittleEndian.Uint64(b[16:]))
	require.Equal(t, []byte{0xAA, 0xAA, 0xAA}, b[24:], "bytes past the last word are untouched")
}

func TestHostChecksum(t *testing.T) {
	require.Zero(t, HostChecksum(nil))
	require.Zero(t, HostChecksum(make([]byte, 7)), "a partial word does not count")
	zero := make([]byte, 8)
	require.Equal(t, mix64(0), HostChecksum(zero), "word 0 of zeros is mix64(0 ^ 0)")
	two := make([]byte, 16)
	require.Equal(t, mix64(0)+mix64(golden), HostChecksum(two), "word 1 of zeros is mix64(1*golden)")
	// Agrees with the fake driver's independent implementation of kvo_checksum.
	b := make([]byte, 4096+5)
	FillPattern(42, b)
	require.Equal(t, cudafake.Checksum(b), HostChecksum(b))
	for i := 0; i+8 <= len(b); i += 8 {
		require.Equal(t, cudafake.Mix64(42+uint64(i/8)), binary.LittleEndian.Uint64(b[i:]))
	}
	// A swapped pair of words changes the sum (position matters).
	c := append([]byte(nil), b...)
	copy(c[0:8], b[8:16])
	copy(c[8:16], b[0:8])
	require.NotEqual(t, HostChecksum(b), HostChecksum(c))
}
