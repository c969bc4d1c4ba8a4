package cudacopy

import (
	"encoding/json"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
)

// anchorTable is shaped like ANCHORS.md's H200 measurements: the kernel
// leads at small segments, the batch API overtakes it for large H2D.
func anchorTable() *Calibration {
	var c Calibration
	add := func(dir Direction, m Method, kib uint64, gbps float64) {
		c.Entries = append(c.Entries, Measurement{Dir: dir, Method: m, SegBytes: kib << 10, GBps: gbps})
	}
	for _, r := range []struct {
		kib                  uint64
		mem, batch, kern     float64
		hmem, hbatch, hkern2 float64
	}{
		{4, 1.4, 5.5, 52.1, 1.4, 4.3, 50.7},
		{16, 5.8, 30.3, 52.4, 5.2, 12.4, 51.1},
		{64, 17.2, 47.1, 52.4, 15.9, 51.3, 51.2},
		{256, 36.6, 52.8, 52.6, 34.0, 53.7, 51.2},
		{2048, 52.0, 55.0, 52.4, 51.3, 54.9, 51.3},
	} {
		add(D2H, MethodMemcpy, r.kib, r.mem)
		add(D2H, MethodBatch, r.kib, r.batch)
		add(D2H, MethodKernel, r.kib, r.kern)
		add(H2D, MethodMemcpy, r.kib, r.hmem)
		add(H2D, MethodBatch, r.kib, r.hbatch)
		add(H2D, MethodKernel, r.kib, r.hkern2)
	}
	return &c
}

func segsOf(n int, size uint64, align uint64) []Segment {
	s := make([]Segment, n)
	for i := range s {
		s[i] = Segment{Dst: 0x100000 + uint64(i)*size*2 + align, Src: 0x900000000 + uint64(i)*size, Len: size}
	}
	return s
}

func TestChoose(t *testing.T) {
	tab := anchorTable()
	tests := []struct {
		name           string
		cal            *Calibration
		batch, kernel  bool
		dir            Direction
		n              int
		size, misalign uint64
		want           Method
	}{
		{"one segment is memcpy", tab, true, true, D2H, 1, 4 << 10, 0, MethodMemcpy},
		{"small d2h kernel", tab, true, true, D2H, 64, 4 << 10, 0, MethodKernel},
		{"small h2d kernel", tab, true, true, H2D, 64, 16 << 10, 0, MethodKernel},
		{"large h2d batch", tab, true, true, H2D, 64, 256 << 10, 0, MethodBatch},
		{"2 MiB d2h batch", tab, true, true, D2H, 8, 2 << 20, 0, MethodBatch},
		{"beyond the table clamps", tab, true, true, D2H, 4, 64 << 20, 0, MethodBatch},
		{"below the table clamps", tab, true, true, D2H, 64, 512, 0, MethodKernel},
		{"misaligned avoids kernel", tab, true, true, D2H, 64, 4 << 10, 8, MethodBatch},
		{"no batch api", tab, false, true, H2D, 64, 256 << 10, 0, MethodKernel},
		{"no batch api, misaligned", tab, false, true, H2D, 64, 256 << 10, 8, MethodMemcpy},
		{"no kernel", tab, true, false, D2H, 64, 4 << 10, 0, MethodBatch},
		{"uncalibrated prefers kernel", nil, true, true, H2D, 64, 2 << 20, 0, MethodKernel},
		{"uncalibrated without kernel", nil, true, false, H2D, 64, 4 << 10, 0, MethodBatch},
		{"uncalibrated dma only", nil, false, false, H2D, 64, 4 << 10, 0, MethodMemcpy},
		{"uncalibrated direction", tab, true, true, D2D, 64, 4 << 10, 0, MethodKernel},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			segs := segsOf(tc.n, tc.size, tc.misalign)
			var total uint64
			for _, s := range segs {
				total += s.Len
			}
			ch := newChooser(tc.cal, tc.batch, tc.kernel)
			require.Equal(t, tc.want, ch.choose(tc.dir, len(segs), total, aligned(segs)))
		})
	}
}

// Between calibrated sizes the rate is interpolated in log2(size): the
// batch API at 32 KiB H2D sits halfway between 16 and 64 KiB.
func TestRateInterpolation(t *testing.T) {
	ch := newChooser(anchorTable(), true, true)
	r, ok := rate(ch.curves[H2D][MethodBatch], 32<<10)
	require.True(t, ok)
	require.InDelta(t, (12.4+51.3)/2, r, 1e-9)
	_, ok = rate(nil, 4096)
	require.False(t, ok)
	// A table measured at one size only gives that rate everywhere.
	one := newChooser(&Calibration{Entries: []Measurement{{Dir: D2H, Method: MethodBatch, SegBytes: 4096, GBps: 9}}}, true, true)
	r, ok = rate(one.curves[D2H][MethodBatch], 1<<30)
	require.True(t, ok)
	require.Equal(t, 9.0, r)
	// With only the batch method measured, it wins even though the kernel
	// is available: the choice follows measurements, not preference.
	require.Equal(t, MethodBatch, one.choose(D2H, 10, 40960, true))
}

func TestCalibrationValidate(t *testing.T) {
	good := anchorTable()
	require.NoError(t, good.Validate())
	for _, bad := range []Measurement{
		{Dir: 0, Method: MethodBatch, SegBytes: 1, GBps: 1},
		{Dir: D2H, Method: MethodAuto, SegBytes: 1, GBps: 1},
		{Dir: D2H, Method: Method(7), SegBytes: 1, GBps: 1},
		{Dir: D2H, Method: MethodBatch, SegBytes: 0, GBps: 1},
		{Dir: D2H, Method: MethodBatch, SegBytes: 1, GBps: math.NaN()},
		{Dir: D2H, Method: MethodBatch, SegBytes: 1, GBps: -1},
	} {
		c := Calibration{Entries: []Measurement{bad}}
		require.ErrorIs(t, c.Validate(), ErrInvalidOption, "%+v", bad)
	}
}

func TestCalibrationJSONAndMarkdown(t *testing.T) {
	tab := anchorTable()
	tab.Device = "NVIDIA H200"
	b, err := json.Marshal(tab)
	require.NoError(t, err)
	require.Contains(t, string(b), `"method":"kernel"`)
	require.Contains(t, string(b), `"dir":"h2d"`)
	var back Calibration
	require.NoError(t, json.Unmarshal(b, &back))
	require.Equal(t, *tab, back)

	md := tab.Markdown()
	require.Contains(t, md, "| dir | segment | memcpy GB/s | batch GB/s | kernel GB/s | chosen |")
	require.Contains(t, md, "| d2h | 4 KiB | 1.4 | 5.5 | 52.1 | kernel |")
	require.Contains(t, md, "| h2d | 256 KiB | 34.0 | 53.7 | 51.2 | batch |")
}

func TestFormatBytes(t *testing.T) {
	for n, want := range map[uint64]string{100: "100 B", 4096: "4 KiB", 2 << 20: "2 MiB", 3 << 29: "1.5 GiB"} {
		require.Equal(t, want, FormatBytes(n))
	}
}
