package record

import (
	"bytes"
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
)

// Checksum, parallel or not, is the CRC-32C of the whole payload: lengths
// around every split point (pieces of unequal length, a last piece longer
// than the rest), at every way count GOMAXPROCS allows.
func TestChecksumIsCRC32C(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	p := make([]byte, 3<<20+17)
	for i := range p {
		p[i] = byte(r.Uint32())
	}
	lengths := []int{0, 1, 4095, parallelMin - 1, parallelMin, parallelMin + 1, 2 << 20, 2<<20 + 4096, 2<<20 + 3, 3 << 20, len(p)}
	for range 8 {
		lengths = append(lengths, parallelMin+r.IntN(len(p)-parallelMin))
	}
	prev := runtime.GOMAXPROCS(0)
	defer runtime.GOMAXPROCS(prev)
	for _, procs := range []int{1, 2, 3, 4, 8, 12, 16} {
		runtime.GOMAXPROCS(procs)
		for _, n := range lengths {
			require.Equal(t, crc32.Checksum(p[:n], castagnoli), Checksum(p[:n]), "%d bytes, GOMAXPROCS %d", n, procs)
		}
	}
}

// ChecksumUpdate of a payload's head checksum over its tail is the
// payload's Checksum, at any split (an empty head or tail included).
func TestChecksumUpdate(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	p := make([]byte, 2<<20+4096)
	for i := range p {
		p[i] = byte(r.Uint32())
	}
	for _, cut := range []int{0, 1, 4096, 7 << 18, len(p) - 1, len(p)} {
		require.Equal(t, Checksum(p), ChecksumUpdate(Checksum(p[:cut]), p[cut:]), "cut at %d", cut)
	}
}

// CopyChecksum copies min(len(dst), len(src)) bytes and returns their
// CRC-32C, for lengths around its pieces; bytes past the copy are untouched.
func TestCopyChecksum(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	src := make([]byte, 40*copyPiece+9)
	for i := range src {
		src[i] = byte(r.Uint32())
	}
	prev := runtime.GOMAXPROCS(0)
	defer runtime.GOMAXPROCS(prev)
	lengths := []int{0, 1, copyPiece - 1, copyPiece, copyPiece + 1, 3 * copyPiece, 5*copyPiece + 9,
		copyParallelMin - 1, copyParallelMin, copyParallelMin + 1, copyParallelMin + 4095, 2 << 20, len(src)}
	for range 6 {
		lengths = append(lengths, copyParallelMin+r.IntN(len(src)-copyParallelMin))
	}
	for _, procs := range []int{1, 2, 4, 8, 16} {
		runtime.GOMAXPROCS(procs)
		for _, n := range lengths {
			for _, extra := range []int{0, 5} {
				dst := make([]byte, n+extra)
				for i := range dst {
					dst[i] = 0xee
				}
				require.Equal(t, crc32.Checksum(src[:n], castagnoli), CopyChecksum(dst, src[:n]), "%d bytes, GOMAXPROCS %d", n, procs)
				require.Equal(t, src[:n], dst[:n])
				require.Equal(t, bytes.Repeat([]byte{0xee}, extra), dst[n:], "past the copy")
			}
			short := make([]byte, n/2)
			require.Equal(t, crc32.Checksum(src[:n/2], castagnoli), CopyChecksum(short, src[:n]), "a shorter dst: %d bytes", n/2)
			for _, ways := range []int{-1, 0, 1, 3, 64} {
				dst := make([]byte, n)
				require.Equal(t, crc32.Checksum(src[:n], castagnoli), CopyChecksumWays(dst, src[:n], ways), "%d bytes, %d ways, GOMAXPROCS %d", n, ways, procs)
				require.Equal(t, src[:n], dst)
			}
		}
	}
}

// combine joins the CRCs of two parts into the CRC of both, for any split.
func TestCombine(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	p := make([]byte, 70_000)
	for i := range p {
		p[i] = byte(r.Uint32())
	}
	for range 200 {
		n := r.IntN(len(p) + 1)
		k := r.IntN(n + 1)
		a, b := crc32.Checksum(p[:k], castagnoli), crc32.Checksum(p[k:n], castagnoli)
		require.Equal(t, crc32.Checksum(p[:n], castagnoli), combine(a, b, n-k), "split %d of %d", k, n)
	}
}

// BenchmarkChecksum2MiB: a 2 MiB payload, cold in the caches as after a
// DMA (each iteration checksums another of 64 buffers: 128 MiB).
func BenchmarkChecksum2MiB(b *testing.B) {
	bufs := make([][]byte, benchBufs)
	for i := range bufs {
		bufs[i] = make([]byte, 2<<20)
		for j := range bufs[i] {
			bufs[i][j] = byte(j * i)
		}
	}
	b.Run("serial", func(b *testing.B) {
		b.SetBytes(2 << 20)
		for i := range b.N {
			crc32.Checksum(bufs[i%len(bufs)], castagnoli)
		}
	})
	b.Run("Checksum", func(b *testing.B) {
		b.SetBytes(2 << 20)
		for i := range b.N {
			Checksum(bufs[i%len(bufs)])
		}
	})
}

var benchBufs = 64

// BenchmarkChecksumWays: Checksum's split of a cold 2 MiB payload over 1
// to 16 goroutines (pieces of at least parallelPiece), as in
// BenchmarkChecksum2MiB.
func BenchmarkChecksumWays(b *testing.B) {
	bufs := make([][]byte, benchBufs)
	for i := range bufs {
		bufs[i] = make([]byte, 2<<20)
		for j := range bufs[i] {
			bufs[i][j] = byte(j * i)
		}
	}
	for _, ways := range []int{1, 4, 8, 12, 16} {
		b.Run(fmt.Sprintf("ways=%d", ways), func(b *testing.B) {
			b.SetBytes(2 << 20)
			for i := range b.N {
				checksumWays(bufs[i%len(bufs)], ways)
			}
		})
	}
}

// BenchmarkCopyChecksumWays: CopyChecksum of a warm 256 KiB source (a
// cluster record's payload) into one of 24 destinations in turn, on 1 to
// 8 goroutines.
func BenchmarkCopyChecksumWays(b *testing.B) {
	src := make([]byte, 256<<10)
	for i := range src {
		src[i] = byte(i * 7)
	}
	dsts := make([][]byte, 24)
	for i := range dsts {
		dsts[i] = make([]byte, len(src))
	}
	for _, ways := range []int{1, 2, 4} {
		b.Run(fmt.Sprintf("ways=%d", ways), func(b *testing.B) {
			b.SetBytes(int64(len(src)))
			for i := range b.N {
				copyChecksumWays(dsts[i%len(dsts)], src, ways)
			}
		})
	}
}

// BenchmarkCopyChecksum: CopyChecksum against a copy and then Checksum of
// the copy (the cluster tier's PutAsync before it), of a warm source into
// one of 24 destinations in turn (a pool of buffers, not in the cache).
func BenchmarkCopyChecksum(b *testing.B) {
	for _, size := range []int{256 << 10, 2 << 20} {
		src := make([]byte, size)
		for i := range src {
			src[i] = byte(i * 7)
		}
		dsts := make([][]byte, 24)
		for i := range dsts {
			dsts[i] = make([]byte, size)
		}
		for _, v := range []struct {
			name string
			f    func(dst, src []byte) uint32
		}{
			{"fused", CopyChecksum},
			{"separate", func(dst, src []byte) uint32 { copy(dst, src); return Checksum(dst) }},
		} {
			b.Run(fmt.Sprintf("%s/%dKiB", v.name, size>>10), func(b *testing.B) {
				b.SetBytes(int64(size))
				for i := range b.N {
					v.f(dsts[i%len(dsts)], src)
				}
			})
		}
	}
}
