package main

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseSize(t *testing.T) {
	tests := []struct {
		in   string
		want int64
		bad  bool
	}{
		{in: "4096", want: 4096},
		{in: "0", want: 0},
		{in: "64KiB", want: 64 << 10},
		{in: "64k", want: 64 << 10},
		{in: "1GiB", want: 1 << 30},
		{in: "1 GiB", want: 1 << 30},
		{in: "2G", want: 2 << 30},
		{in: "1.5GiB", want: 3 << 29},
		{in: "100GB", want: 100e9},
		{in: "3MB", want: 3e6},
		{in: "1TiB", want: 1 << 40},
		{in: "512B", want: 512},
		{in: "256TiB", want: 256 << 40},
		{in: "257TiB", bad: true},
		{in: "1.0000001KiB", bad: true},
		{in: "GiB", bad: true},
		{in: "", bad: true},
		{in: "-1GiB", bad: true},
		{in: "-1", bad: true},
		{in: " -0", bad: true},
		{in: "1XB", bad: true},
		{in: "1.2.3MiB", bad: true},
		{in: "99999999999999999999", bad: true},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := parseSize(tt.in)
			if tt.bad {
				require.ErrorIs(t, err, errSize)
				require.Contains(t, err.Error(), tt.in)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tt.want, got)
		})
	}
}

func TestFormatSize(t *testing.T) {
	for in, want := range map[int64]string{
		0: "0 B", 512: "512 B", 1 << 10: "1 KiB", 3 << 29: "1.5 GiB", 1 << 30: "1 GiB",
		100 << 20: "100 MiB", 12345678: "11.8 MiB", 1 << 40: "1 TiB",
	} {
		require.Equal(t, want, formatSize(in), "formatSize(%d)", in)
	}
}

func TestSizeFlagRoundTrip(t *testing.T) {
	for _, n := range []int64{0, 1, 4096, 1 << 30, 3 << 29, 12345} {
		var v int64
		f := sizeFlag{&v}
		require.NoError(t, f.Set(formatSizeFlag(n)))
		require.Equal(t, n, v)
		require.Equal(t, formatSizeFlag(n), f.String())
	}
}

func FuzzParseSize(f *testing.F) {
	for _, s := range []string{"1GiB", "1.5G", "100GB", "4096", "x", "1e9", ".5KiB", "256TiB"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n, err := parseSize(s)
		if err != nil {
			require.ErrorIs(t, err, errSize)
			return
		}
		require.GreaterOrEqual(t, n, int64(0))
		require.LessOrEqual(t, n, maxSize)
		back, err := parseSize(formatSizeFlag(n))
		require.NoError(t, err)
		require.Equal(t, n, back)
	})
}
