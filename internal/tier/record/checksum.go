package record

import (
	"hash/crc32"
	"runtime"
	"sync"
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// ChecksumUpdate extends sum, the Checksum of the bytes before p, over p:
// Checksum(append(a, b...)) == ChecksumUpdate(Checksum(a), b). For a
// payload checksummed in pieces as they arrive (a disk Get's split read).
func ChecksumUpdate(sum uint32, p []byte) uint32 { return crc32.Update(sum, castagnoli, p) }

// Checksum returns the CRC-32C (Castagnoli) of p, the payload checksum
// Header.PayloadSum holds. A payload of at least parallelMin bytes is
// checksummed in up to parallelWays pieces on as many goroutines (no more
// than half of GOMAXPROCS: on the 2-CPU VM two pieces took longer than
// one, warm or cold), their CRCs combined: a payload a disk just wrote by DMA
// is not in any cache, and one core reads it at DRAM speed (a 2 MiB
// record's CRC took 260-380 µs right after its O_DIRECT read on the 2-CPU
// VM against 97 µs warm, a tenth of the read's time that Get added before
// a record could be served). Up to 8 pieces: on one H200 machine instance
// (16 vCPUs, BenchmarkChecksumWays, cold 2 MiB) 1/4/8 ways took
// 314-369/161-175/99-100 µs; on another, 460-477/266-323/257-326 µs (8
// ways no slower there).
func Checksum(p []byte) uint32 {
	return checksumWays(p, min(parallelWays, runtime.GOMAXPROCS(0)/2))
}

// checksumWays is Checksum on at most ways goroutines.
func checksumWays(p []byte, ways int) uint32 {
	ways = min(ways, len(p)/parallelPiece)
	if len(p) < parallelMin || ways < 2 {
		return crc32.Checksum(p, castagnoli)
	}
	return inPieces(len(p), ways, func(lo, hi int) uint32 { return crc32.Checksum(p[lo:hi], castagnoli) })
}

// inPieces splits [0, n) into ways pieces (the last one takes the rest),
// runs f on each, the first on the calling goroutine and the others on
// their own, and returns the CRC of the whole from the pieces' CRCs.
func inPieces(n, ways int, f func(lo, hi int) uint32) uint32 {
	piece := n / ways
	sums := make([]uint32, ways)
	var wg sync.WaitGroup
	for i := 1; i < ways; i++ {
		lo, hi := i*piece, (i+1)*piece
		if i == ways-1 {
			hi = n
		}
		wg.Go(func() { sums[i] = f(lo, hi) })
	}
	sums[0] = f(0, piece)
	wg.Wait()
	sum := sums[0]
	for i := 1; i < ways; i++ {
		m := piece
		if i == ways-1 {
			m = n - i*piece
		}
		sum = combine(sum, sums[i], m)
	}
	return sum
}

// Parallel checksum bounds: payloads from parallelMin bytes, pieces of at
// least parallelPiece bytes, at most parallelWays of them.
const (
	parallelMin   = 1 << 20
	parallelPiece = 256 << 10
	parallelWays  = 8
)

// combine returns the CRC-32C of A‖B from crcA = CRC(A), crcB = CRC(B)
// and n = len(B): crcA advanced over n zero bytes (a linear map over
// GF(2), cached per n), XORed with crcB. (The pre- and post-inversion of
// the standard CRC cancel out in this form, as in zlib's crc32_combine.)
func combine(crcA, crcB uint32, n int) uint32 {
	return gf2Times(zerosOp(n), crcA) ^ crcB
}

// gf2Matrix is a linear map on 32-bit CRC states over GF(2): column i is
// the image of bit i.
type gf2Matrix [32]uint32

func gf2Times(m *gf2Matrix, v uint32) uint32 {
	var sum uint32
	for i := 0; v != 0; i, v = i+1, v>>1 {
		if v&1 != 0 {
			sum ^= m[i]
		}
	}
	return sum
}

func gf2Square(m *gf2Matrix) gf2Matrix {
	var sq gf2Matrix
	for i := range sq {
		sq[i] = gf2Times(m, m[i])
	}
	return sq
}

var zeroOps sync.Map // int (bytes) → *gf2Matrix

// zerosOp returns the map that advances a (reflected, uninverted) CRC-32C
// state over n zero bytes. Payload sizes are few (one per record size), so
// each is computed once.
func zerosOp(n int) *gf2Matrix {
	if m, ok := zeroOps.Load(n); ok {
		return m.(*gf2Matrix)
	}
	// One zero bit: shift right, XOR the polynomial in when the low bit
	// was set.
	var bit gf2Matrix
	bit[0] = crc32.Castagnoli
	for i := 1; i < 32; i++ {
		bit[i] = 1 << (i - 1)
	}
	byteOp := gf2Square(&bit)
	byteOp = gf2Square(&byteOp)
	byteOp = gf2Square(&byteOp) // 8 zero bits
	// The identity, then square-and-multiply over n's bits.
	var acc gf2Matrix
	for i := range acc {
		acc[i] = 1 << i
	}
	pow := byteOp
	for k := n; k > 0; k >>= 1 {
		if k&1 != 0 {
			var next gf2Matrix
			for i := range next {
				next[i] = gf2Times(&pow, acc[i])
			}
			acc = next
		}
		pow = gf2Square(&pow)
	}
	m := &acc
	zeroOps.Store(n, m)
	return m
}

// CopyChecksum copies src into dst (as copy does: min of the lengths) and
// returns the CRC-32C of the bytes copied, computed on each piece of dst
// right after its copy, while it is in the cache: one pass over memory
// where a copy and then Checksum make two (the cluster tier's PutAsync,
// which copies a payload behind its record header). From copyParallelMin
// bytes it runs on up to parallelWays goroutines (no more than half of
// GOMAXPROCS, pieces of at least copyParallelPiece), as Checksum does: a
// PutAsync's caller waits for it (PutAsyncFrom's caller does not, and there
// the pieces only shorten the slot's lease).
func CopyChecksum(dst, src []byte) uint32 {
	return copyChecksumWays(dst, src, min(parallelWays, runtime.GOMAXPROCS(0)/2))
}

// CopyChecksumWays is CopyChecksum on at most ways goroutines (and no more
// than CopyChecksum would use): for a caller running several copies at once,
// whose own concurrency already keeps the cores busy. ways < 2 copies on the
// calling goroutine.
func CopyChecksumWays(dst, src []byte, ways int) uint32 {
	return copyChecksumWays(dst, src, min(ways, parallelWays, runtime.GOMAXPROCS(0)/2))
}

// copyChecksumWays is CopyChecksum on at most ways goroutines.
func copyChecksumWays(dst, src []byte, ways int) uint32 {
	n := min(len(dst), len(src))
	ways = min(ways, n/copyParallelPiece)
	if n < copyParallelMin || ways < 2 {
		return copyChecksum(dst[:n], src[:n])
	}
	return inPieces(n, ways, func(lo, hi int) uint32 { return copyChecksum(dst[lo:hi], src[lo:hi]) })
}

// copyChecksum is CopyChecksum on the calling goroutine, for len(dst) ==
// len(src).
func copyChecksum(dst, src []byte) uint32 {
	var sum uint32
	for off := 0; off < len(src); off += copyPiece {
		end := min(off+copyPiece, len(src))
		copy(dst[off:end], src[off:end])
		sum = crc32.Update(sum, castagnoli, dst[off:end])
	}
	return sum
}

// copyPiece is CopyChecksum's piece: well within a core's L2 (16 KiB pieces
// measured the same, 128 KiB a little faster on the 2-CPU VM).
const copyPiece = 64 << 10

// CopyChecksum's parallel bounds: from copyParallelMin bytes (a cluster
// record of 256 KiB: 4 pieces), pieces of at least copyParallelPiece.
const (
	copyParallelMin   = 256 << 10
	copyParallelPiece = 64 << 10
)
