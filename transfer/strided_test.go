package transfer_test

import (
	"bytes"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	. "github.com/kvoffload/kvoffload/internal/cudadev"
	. "github.com/kvoffload/kvoffload/transfer"
)

// TestStridedSim stores 2-D segments (rows of a "head" at a device pitch,
// back to back on the host) through the Scheduler and the Sim, then loads
// them into another device area, and checks every byte, the untouched gaps
// between rows included.
func TestStridedSim(t *testing.T) {
	const size = 1 << 16
	e := newSimEnv(t, size, Config{Align: 16}, SimConfig{Seed: 7})
	r := rand.New(rand.NewSource(3))
	src := randBytes(r, size/2)
	require.NoError(t, e.sim.Write(e.dev, src))
	// 4 heads of 16 rows of 64 bytes, interleaved on the device (pitch 256).
	const rows, row, heads = 16, 64, 4
	var st []Segment
	for h := uint64(0); h < heads; h++ {
		st = append(st, Segment{Dev: e.dev + h*row, Host: e.host + h*rows*row, Len: rows * row,
			Rows: rows, RowLen: row, DevPitch: heads * row, HostPitch: row})
	}
	op, err := e.s.Submit(Request{Dir: Store, Segments: st})
	require.NoError(t, err)
	require.NoError(t, op.Wait())
	require.NoError(t, op.Release())
	for h := 0; h < heads; h++ {
		for k := 0; k < rows; k++ {
			want := src[k*heads*row+h*row : k*heads*row+(h+1)*row]
			got := e.hostBuf[(h*rows+k)*row : (h*rows+k+1)*row]
			require.Equal(t, want, got, "head %d row %d on the host", h, k)
		}
	}
	// Load heads 1 and 2 only into a poisoned area laid out for 2 heads.
	dst := e.dev + size/2
	require.NoError(t, e.sim.Fill(dst, size/2, 0xAB))
	var ld []Segment
	for h := uint64(1); h < 3; h++ {
		ld = append(ld, Segment{Dev: dst + (h-1)*row, Host: e.host + h*rows*row, Len: rows * row,
			Rows: rows, RowLen: row, DevPitch: 2 * row, HostPitch: row})
	}
	op, err = e.s.Submit(Request{Dir: Load, Segments: ld})
	require.NoError(t, err)
	require.NoError(t, op.Wait())
	require.NoError(t, op.Release())
	got := make([]byte, 2*rows*row+16)
	require.NoError(t, e.sim.Read(dst, got))
	for k := 0; k < rows; k++ {
		want := src[k*heads*row+row : k*heads*row+3*row]
		require.True(t, bytes.Equal(want, got[k*2*row:(k+1)*2*row]), "row %d loaded", k)
	}
	require.Equal(t, bytes.Repeat([]byte{0xAB}, 16), got[2*rows*row:], "bytes past the rows untouched")
}

// TestStridedValidation: a 2-D segment's whole extent is checked against
// the ranges, and its fields against each other.
func TestStridedValidation(t *testing.T) {
	e := newSimEnv(t, 1<<16, Config{Align: 16}, SimConfig{})
	good := Segment{Dev: e.dev, Host: e.host, Len: 16 * 64, Rows: 16, RowLen: 64, DevPitch: 256, HostPitch: 64}
	mod := func(f func(*Segment)) Segment { s := good; f(&s); return s }
	tests := []struct {
		name string
		seg  Segment
		want error
	}{
		{"device extent past the allocation", mod(func(s *Segment) { s.Dev = e.dev + 1<<16 - 16*64 }), ErrOutOfRange},
		{"host extent past the range", mod(func(s *Segment) { s.HostPitch = 4096; s.Host = e.host + 1<<16 - 4096 }), ErrOutOfRange},
		{"len not rows × row", mod(func(s *Segment) { s.Len = 16 * 64 * 2 }), ErrInvalidSegment},
		{"pitch below the row", mod(func(s *Segment) { s.DevPitch = 32 }), ErrInvalidSegment},
		{"misaligned pitch", mod(func(s *Segment) { s.DevPitch = 264 }), ErrInvalidSegment},
		{"overflowing pitch", mod(func(s *Segment) { s.DevPitch = 1 << 62 }), ErrInvalidSegment},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := e.s.Submit(Request{Dir: Store, Segments: []Segment{tc.seg}})
			require.ErrorIs(t, err, tc.want)
		})
	}
	op, err := e.s.Submit(Request{Dir: Store, Segments: []Segment{good}})
	require.NoError(t, err)
	require.NoError(t, op.Wait())
	require.NoError(t, op.Release())
}
