package cudacopy

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
)

// BenchmarkGPUHeadPattern isolates the copier from the engine: a TP=4
// rank's head-sliced blocks (1024 blocks × 32 layers × K/V × 2 heads, each
// head 16 rows of 256 bytes, 512 MiB in all) between a head-major host
// buffer and token-major device tensors (rows at a pitch of 512 bytes),
// submitted straight to the kernel in parts of `part` segments, against
// the same bytes as 1-D 4 KiB segments (the device side contiguous), as
// 2-D segments whose pitch is their row (contiguous both sides: the 2-D
// code on a 1-D pattern), and a contiguous cuMemcpyAsync of the 512 MiB,
// all timed with events on one stream in the same run. It reports each
// shape's GB/s and share of the contiguous copy, each way; the table goes
// to KVO_BENCH_OUT/headpattern.md.
func BenchmarkGPUHeadPattern(b *testing.B) {
	g := cudatest.Open(b)
	drv := g.Drv
	const blocks, tensors, heads, rows, row = 1024, 64, 2, 16, 256
	const headBytes = rows * row
	const total = blocks * tensors * heads * headBytes
	host := hostMem(b, drv, 4*total) // room for the rank's heads in whole blocks (4 ranks' worth)
	for i := range host {
		host[i] = byte(i * 7)
	}
	hostP := addr(host)
	dev := uint64(devMem(b, drv, total))
	s := newStream(b, drv)
	c := newCopier(b, drv, Options{Method: MethodKernel})
	e0, err := drv.EventCreate(cuda.EventDefault)
	require.NoError(b, err)
	e1, err := drv.EventCreate(cuda.EventDefault)
	require.NoError(b, err)
	defer func() { _ = drv.EventDestroy(e0); _ = drv.EventDestroy(e1) }()

	// shape gives head (blk, t, h)'s copy host-side first: its rows on the
	// host and on the device, with each side's pitch; host offset o is
	// ((blk·tensors + t)·heads + h)·headBytes. seg orients it.
	type shape struct {
		name string
		side func(blk, t, h int) (o, d uint64, rows, rowLen, hostPitch, devPitch uint64)
	}
	seg := func(sh shape, h2d bool, blk, t, hd int) Segment2D {
		o, d, n, r, hp, dp := sh.side(blk, t, hd)
		if h2d {
			return Segment2D{Src: o, Dst: d, Rows: n, RowLen: r, SrcPitch: hp, DstPitch: dp}
		}
		return Segment2D{Src: d, Dst: o, Rows: n, RowLen: r, SrcPitch: dp, DstPitch: hp}
	}
	shapes := []shape{
		{"2-D 16×256 B, device pitch 512 (head-sliced)", func(blk, t, hd int) (uint64, uint64, uint64, uint64, uint64, uint64) {
			return hostP + uint64(((blk*tensors+t)*heads+hd)*headBytes), dev + uint64(t*blocks*heads*headBytes+blk*heads*headBytes+hd*row),
				rows, row, row, heads * row
		}},
		{"2-D 16×256 B, pitch 256 (contiguous)", func(blk, t, hd int) (uint64, uint64, uint64, uint64, uint64, uint64) {
			return hostP + uint64(((blk*tensors+t)*heads+hd)*headBytes), dev + uint64(t*blocks*heads*headBytes+blk*heads*headBytes+hd*headBytes),
				rows, row, row, row
		}},
		{"2-D 16×256 B, device pitch 512, host: the rank's 2 of 8 heads of a whole block", func(blk, t, hd int) (uint64, uint64, uint64, uint64, uint64, uint64) {
			return hostP + uint64(((blk*tensors+t)*4*heads+heads+hd)*headBytes), // heads [2, 4) of 8
				dev + uint64(t*blocks*heads*headBytes+blk*heads*headBytes+hd*row), rows, row, row, heads * row
		}},
		{"1-D 4 KiB", func(blk, t, hd int) (uint64, uint64, uint64, uint64, uint64, uint64) {
			return hostP + uint64(((blk*tensors+t)*heads+hd)*headBytes), dev + uint64(t*blocks*heads*headBytes+blk*heads*headBytes+hd*headBytes),
				1, headBytes, 0, 0
		}},
	}
	timed := func(run func() []Ticket) float64 {
		best := 0.0
		for range 3 {
			require.NoError(b, drv.EventRecord(e0, s))
			tks := run()
			require.NoError(b, drv.EventRecord(e1, s))
			require.NoError(b, drv.EventSynchronize(e1))
			for _, tk := range tks {
				require.NoError(b, c.Retire(tk))
			}
			ms, err := drv.EventElapsedTime(e0, e1)
			require.NoError(b, err)
			best = max(best, float64(total)/float64(ms)/1e6)
		}
		return best
	}
	memcpy := func(h2d bool) float64 {
		return timed(func() []Ticket {
			if h2d {
				require.NoError(b, drv.MemcpyAsync(cuda.DevicePtr(dev), cuda.DevicePtr(hostP), total, s))
			} else {
				require.NoError(b, drv.MemcpyAsync(cuda.DevicePtr(hostP), cuda.DevicePtr(dev), total, s))
			}
			return nil
		})
	}
	var lines []string
	for _, h2d := range []bool{true, false} {
		dir, name := H2D, "H2D"
		if !h2d {
			dir, name = D2H, "D2H"
		}
		link := memcpy(h2d)
		for _, sh := range shapes {
			segs := make([]Segment2D, 0, blocks*tensors*heads)
			for blk := range blocks {
				for t := range tensors {
					for hd := range heads {
						segs = append(segs, seg(sh, h2d, blk, t, hd))
					}
				}
			}
			for _, part := range []int{4096, 32768} {
				gbs := timed(func() []Ticket {
					var tks []Ticket
					for i := 0; i < len(segs); i += part {
						tk, err := c.Submit2D(s, dir, segs[i:min(i+part, len(segs))])
						require.NoError(b, err)
						tks = append(tks, tk)
					}
					return tks
				})
				lines = append(lines, fmt.Sprintf("| %s | %s | %d | %.1f | %.1f%% |", name, sh.name, part, gbs, 100*gbs/link))
			}
			// The same parts prepared before the timing: only SubmitPrepared
			// (the descriptor table's upload and the launch) is timed, the
			// GPU's rate with the host's encoding out of the way.
			const part = 4096
			preps := make([]Prepared, (len(segs)+part-1)/part)
			for k := range preps {
				require.NoError(b, c.Prepare2D(dir, segs[k*part:min((k+1)*part, len(segs))], &preps[k]))
			}
			gbs := timed(func() []Ticket {
				var tks []Ticket
				for k := range preps {
					tk, err := c.SubmitPrepared(s, &preps[k])
					require.NoError(b, err)
					tks = append(tks, tk)
				}
				return tks
			})
			lines = append(lines, fmt.Sprintf("| %s | %s, prepared ahead | %d | %.1f | %.1f%% |", name, sh.name, part, gbs, 100*gbs/link))
		}
		link = max(link, memcpy(h2d))
		lines = append(lines, fmt.Sprintf("| %s | contiguous cuMemcpyAsync (the reference, best before and after) | | %.1f | 100%% |", name, link))
	}
	table := "| dir | shape | segments a submit | GB/s | of the contiguous copy |\n|---|---|---:|---:|---:|\n" + strings.Join(lines, "\n") + "\n"
	b.Log("\n" + table)
	if d := os.Getenv("KVO_BENCH_OUT"); d != "" {
		_ = os.WriteFile(filepath.Join(d, "headpattern.md"), []byte("# The head-sliced pattern through the copy kernel alone\n\n"+table), 0o644)
	}
}
