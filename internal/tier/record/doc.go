// Package record is the one record format the lower tiers share (the disk
// tier now, the cluster tier later): a 4 KiB header sector followed by the
// block's payload in the host layout. It knows nothing of CUDA, of the
// engine, or of where records are kept.
//
// # The header sector
//
// HeaderSize (4096) bytes, so that a payload that follows it stays aligned
// for O_DIRECT. The fields sit in its first HeaderLen (64) bytes,
// little-endian; the rest of the sector is zero:
//
//	off len  field
//	  0   8  magic "KVOREC\x00\x01"
//	  8   2  format version (FormatVersion)
//	 10   2  reserved, zero
//	 12   4  host-layout version (HostLayoutVersion when written by this engine)
//	 16   8  fingerprint (Fingerprint of the namespace, geometry and dtype)
//	 24  16  key
//	 40   8  payload length in bytes (at most MaxPayloadBytes)
//	 48   4  payload checksum: CRC-32C (Castagnoli) of the payload
//	 52   4  reserved, zero
//	 56   4  header checksum: CRC-32C of bytes 0..56
//	 60   4  reserved, zero
//
// # Checksums
//
// Both checksums are CRC-32C from the standard library's hash/crc32
// Castagnoli table: it is hardware accelerated on amd64 (SSE4.2, three
// streams interleaved) and arm64 (the CRC32 instructions), so a 2 MiB block
// costs well under the time to read it from a disk, and it adds no
// dependency. xxh3 would be faster still but needs a module from outside the
// standard library; the checksum is there to catch torn writes and media
// errors, not adversaries, and 32 bits make a corrupt record pass with odds
// of 1 in 4·10⁹.
//
// # Versions
//
// DecodeHeader accepts only FormatVersion. A record of any other format
// version, older or newer, is ErrVersion: a store reading one treats it as a
// miss and reclaims its space. Nothing converts records: they are a cache,
// and the host pool rebuilds them. Header.Check compares the fingerprint and
// the host-layout version with the reader's own (ErrFingerprint,
// ErrLayoutVersion), which a store also treats as a miss.
//
// A record is verified before any of its bytes reach a GPU: DecodeHeader
// (magic, version, header checksum, length bound), Header.Check (fingerprint,
// layout version), the key compared by the caller, then VerifyPayload
// (length and payload checksum).
package record
