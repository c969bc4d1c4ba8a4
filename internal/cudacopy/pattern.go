package cudacopy

import "encoding/binary"

// golden is the 64-bit golden-ratio constant used by mix64 and the checksum.
const golden = 0x9E3779B97F4A7C15

// mix64 is splitmix64's finaliser of x+golden, as in kernels.cu.
func mix64(x uint64) uint64 {
	x += golden
	x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
	x = (x ^ (x >> 27)) * 0x94D049BB133111EB
	return x ^ (x >> 31)
}

// FillPattern writes what kvo_fill writes for a segment with this seed:
// mix64(seed+i) into the little-endian 8-byte word i of b. Bytes past the
// last whole word are left as they are (the kernel never sees them: Fill
// requires lengths that are multiples of 8).
func FillPattern(seed uint64, b []byte) {
	for i := 0; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], mix64(seed+uint64(i/8)))
	}
}

// HostChecksum computes what kvo_checksum writes for b: the wrapping sum over
// its little-endian 8-byte words w[i] of mix64(w[i] ^ i*golden). Bytes past
// the last whole word do not count (Checksum requires lengths that are
// multiples of 8).
func HostChecksum(b []byte) uint64 {
	var sum uint64
	for i := 0; i+8 <= len(b); i += 8 {
		w := binary.LittleEndian.Uint64(b[i:])
		sum += mix64(w ^ uint64(i/8)*golden)
	}
	return sum
}
