package cudacopy

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestValidateSegments(t *testing.T) {
	ok := Segment{Dst: 0x1000, Src: 0x2000, Len: 4096}
	tests := []struct {
		name  string
		segs  []Segment
		align uint64
		want  error
	}{
		{"ok", []Segment{ok}, 1, nil},
		{"ok aligned", []Segment{ok}, 16, nil},
		{"empty", nil, 1, ErrInvalidSegment},
		{"zero length", []Segment{ok, {Dst: 1, Src: 2}}, 1, ErrInvalidSegment},
		{"nil src", []Segment{{Dst: 0x1000, Len: 1}}, 1, ErrInvalidSegment},
		{"nil dst", []Segment{{Src: 0x1000, Len: 1}}, 1, ErrInvalidSegment},
		{"wraps", []Segment{{Dst: 0x1000, Src: ^uint64(0) - 10, Len: 100}}, 1, ErrInvalidSegment},
		{"odd length ok unaligned", []Segment{{Dst: 0x1001, Src: 0x2003, Len: 7}}, 1, nil},
		{"misaligned src", []Segment{{Dst: 0x1000, Src: 0x2008, Len: 16}}, 16, ErrMisaligned},
		{"misaligned len", []Segment{{Dst: 0x1000, Src: 0x2000, Len: 24}}, 16, ErrMisaligned},
		{"alignment not a power of two", []Segment{ok}, 12, ErrInvalidSegment},
		{"alignment zero", []Segment{ok}, 0, ErrInvalidSegment},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := validateSegments(tc.segs, tc.align)
			if tc.want == nil {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, tc.want)
		})
	}
}

func FuzzValidateSegments(f *testing.F) {
	f.Add(uint64(0x1000), uint64(0x2000), uint64(4096), uint8(16))
	f.Add(uint64(0), uint64(0x2000), uint64(1), uint8(1))
	f.Add(^uint64(0), uint64(1), uint64(2), uint8(8))
	f.Fuzz(func(t *testing.T, dst, src, n uint64, align uint8) {
		a := uint64(1) << (align % 7) // 1 to 64: the alignments are powers of two
		err := validateSegments([]Segment{{Dst: dst, Src: src, Len: n}}, a)
		valid := n != 0 && dst != 0 && src != 0 && dst+n >= dst && src+n >= src
		if !valid {
			require.ErrorIs(t, err, ErrInvalidSegment)
			return
		}
		if dst%a != 0 || src%a != 0 || n%a != 0 {
			require.ErrorIs(t, err, ErrMisaligned)
			return
		}
		require.NoError(t, err)
	})
}

func TestNamesRoundTrip(t *testing.T) {
	for _, m := range []Method{MethodAuto, MethodMemcpy, MethodBatch, MethodKernel} {
		b, err := m.MarshalText()
		require.NoError(t, err)
		var got Method
		require.NoError(t, got.UnmarshalText(b))
		require.Equal(t, m, got)
	}
	for _, d := range []Path{D2H, H2D, D2D} {
		b, err := json.Marshal(d)
		require.NoError(t, err)
		var got Path
		require.NoError(t, json.Unmarshal(b, &got))
		require.Equal(t, d, got)
	}
	_, err := ParseMethod("dma")
	require.ErrorIs(t, err, ErrInvalidOption)
	var d Path
	require.ErrorIs(t, d.UnmarshalText([]byte("up")), ErrInvalidOption)
	_, err = Path(0).MarshalText()
	require.ErrorIs(t, err, ErrInvalidOption)
	require.Equal(t, "Method(9)", Method(9).String())
	require.Equal(t, "Path(0)", Path(0).String())
}
