package record

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
)

// Sizes of the header.
const (
	// HeaderSize is the size of the header sector that precedes every
	// payload: one 4 KiB page, the O_DIRECT alignment of common file systems.
	HeaderSize = 4096
	// HeaderLen is the number of bytes of the header sector that hold fields;
	// DecodeHeader reads only these.
	HeaderLen = 64
)

// FormatVersion is the format version this package writes and reads.
const FormatVersion = 1

// HostLayoutVersion is the version of the host layout the engine's payloads
// are in: per layer K then V, each layer's K (or V) either a byte copy of
// the device's segment (HostDeviceOrder) or head-major, each head's
// tokens × head dim contiguous (HostHeadMajor); which of the two is
// in the fingerprint (Geometry.HostFormat), so a reader of one never serves
// a record of the other. It changes when that layout does, so that records
// written in the old layout are misses.
const HostLayoutVersion = 1

// MaxPayloadBytes bounds Header.PayloadLen (4 GiB): the largest blocks of
// real models are a few MiB, so a larger length can only be corruption.
const MaxPayloadBytes = 1 << 32

// magic opens every header sector.
var magic = [8]byte{'K', 'V', 'O', 'R', 'E', 'C', 0, 1}

// Errors. Every error of this package wraps one of these.
var (
	// ErrCorrupt: a bad magic, a header or payload checksum that does not
	// match, a length out of bounds, or a payload of another length than the
	// header says.
	ErrCorrupt = errors.New("record: corrupt")
	// ErrVersion: a record of another format version.
	ErrVersion = errors.New("record: unsupported format version")
	// ErrFingerprint: a record of another namespace, geometry or dtype.
	ErrFingerprint = errors.New("record: fingerprint mismatch")
	// ErrLayoutVersion: a record of another host-layout version.
	ErrLayoutVersion = errors.New("record: host-layout version mismatch")
	// ErrKey: a record of another key than the one read for.
	ErrKey = errors.New("record: key mismatch")
)

// Header is the decoded header sector of one record.
type Header struct {
	Version       uint16   // format version; EncodeHeader writes FormatVersion whatever it holds
	LayoutVersion uint32   // host-layout version of the payload
	Fingerprint   uint64   // Fingerprint(Geometry) of the writer
	Key           [16]byte // the block's key
	PayloadLen    uint64   // payload bytes that follow the header sector
	PayloadSum    uint32   // Checksum(payload)
}

// Field offsets inside the header sector.
const (
	offMagic      = 0
	offVersion    = 8
	offLayout     = 12
	offFP         = 16
	offKey        = 24
	offPayloadLen = 40
	offPayloadSum = 48
	offHeaderSum  = 56
)

// EncodeHeader writes h as a header sector into dst: the fields into
// dst[:HeaderLen] with FormatVersion as the version, zeros into the rest of
// dst up to HeaderSize. It panics if dst is shorter than HeaderLen (as
// encoding/binary's Put functions do).
func EncodeHeader(dst []byte, h Header) {
	_ = dst[HeaderLen-1]
	copy(dst[offMagic:], magic[:])
	binary.LittleEndian.PutUint16(dst[offVersion:], FormatVersion)
	binary.LittleEndian.PutUint16(dst[offVersion+2:], 0)
	binary.LittleEndian.PutUint32(dst[offLayout:], h.LayoutVersion)
	binary.LittleEndian.PutUint64(dst[offFP:], h.Fingerprint)
	copy(dst[offKey:], h.Key[:])
	binary.LittleEndian.PutUint64(dst[offPayloadLen:], h.PayloadLen)
	binary.LittleEndian.PutUint32(dst[offPayloadSum:], h.PayloadSum)
	binary.LittleEndian.PutUint32(dst[offPayloadSum+4:], 0)
	binary.LittleEndian.PutUint32(dst[offHeaderSum:], crc32.Checksum(dst[:offHeaderSum], castagnoli))
	clear(dst[offHeaderSum+4 : min(len(dst), HeaderSize)])
}

// DecodeHeader decodes the header sector at the start of src (only its first
// HeaderLen bytes are read). It verifies the magic, the header checksum, the
// format version and the payload length bound; it does not allocate.
// Errors wrap ErrCorrupt (src shorter than HeaderLen, a bad magic or header
// checksum, a reserved byte not zero, a length over MaxPayloadBytes) or
// ErrVersion.
func DecodeHeader(src []byte) (Header, error) {
	if len(src) < HeaderLen {
		return Header{}, fmt.Errorf("%w: header of %d bytes, need %d", ErrCorrupt, len(src), HeaderLen)
	}
	if [8]byte(src[offMagic:offMagic+8]) != magic {
		return Header{}, fmt.Errorf("%w: bad magic %x", ErrCorrupt, src[offMagic:offMagic+8])
	}
	want := binary.LittleEndian.Uint32(src[offHeaderSum:])
	if got := crc32.Checksum(src[:offHeaderSum], castagnoli); got != want {
		return Header{}, fmt.Errorf("%w: header checksum %08x, stored %08x", ErrCorrupt, got, want)
	}
	h := Header{
		Version:       binary.LittleEndian.Uint16(src[offVersion:]),
		LayoutVersion: binary.LittleEndian.Uint32(src[offLayout:]),
		Fingerprint:   binary.LittleEndian.Uint64(src[offFP:]),
		Key:           [16]byte(src[offKey : offKey+16]),
		PayloadLen:    binary.LittleEndian.Uint64(src[offPayloadLen:]),
		PayloadSum:    binary.LittleEndian.Uint32(src[offPayloadSum:]),
	}
	// The reserved bytes (after the version, after the payload checksum,
	// after the header checksum) are zero in every header EncodeHeader
	// writes; the last four are outside the header checksum, so a header
	// with any of them set is damaged, not merely another writer's.
	if binary.LittleEndian.Uint16(src[offVersion+2:]) != 0 || binary.LittleEndian.Uint32(src[offPayloadSum+4:]) != 0 || binary.LittleEndian.Uint32(src[offHeaderSum+4:]) != 0 {
		return Header{}, fmt.Errorf("%w: reserved header bytes %x %x %x are not zero", ErrCorrupt, src[offVersion+2:offVersion+4], src[offPayloadSum+4:offPayloadSum+8], src[offHeaderSum+4:HeaderLen])
	}
	if h.Version != FormatVersion {
		return Header{}, fmt.Errorf("%w: format version %d, this reader knows %d", ErrVersion, h.Version, FormatVersion)
	}
	if h.PayloadLen > MaxPayloadBytes {
		return Header{}, fmt.Errorf("%w: payload length %d over %d", ErrCorrupt, h.PayloadLen, uint64(MaxPayloadBytes))
	}
	return h, nil
}

// Check compares the header's fingerprint and host-layout version with the
// reader's: ErrFingerprint or ErrLayoutVersion when they differ.
func (h Header) Check(fingerprint uint64, layoutVersion uint32) error {
	if h.Fingerprint != fingerprint {
		return fmt.Errorf("%w: record %016x, reader %016x", ErrFingerprint, h.Fingerprint, fingerprint)
	}
	if h.LayoutVersion != layoutVersion {
		return fmt.Errorf("%w: record %d, reader %d", ErrLayoutVersion, h.LayoutVersion, layoutVersion)
	}
	return nil
}

// VerifyPayload checks that payload is the one h describes: its length and
// its CRC-32C. Errors wrap ErrCorrupt.
func VerifyPayload(h Header, payload []byte) error {
	if uint64(len(payload)) != h.PayloadLen {
		return fmt.Errorf("%w: payload of %d bytes, header says %d", ErrCorrupt, len(payload), h.PayloadLen)
	}
	if got := Checksum(payload); got != h.PayloadSum {
		return fmt.Errorf("%w: payload checksum %08x, header says %08x", ErrCorrupt, got, h.PayloadSum)
	}
	return nil
}

// Accept is the one accept decision of a reader (the disk tier's Get, the
// cluster tier's pipelined and streamed GETs) on the bytes it read for key
// into a destination of n bytes: total is how many bytes the record read
// has (header sector and payload), hdr its first bytes (at least HeaderLen
// when total allows), sum the CRC-32C of its bytes after the header
// sector, called only once everything else passed. It returns nil only
// when the bytes are exactly one record (header sector, then n payload
// bytes) of key, of fingerprint and HostLayoutVersion, whose payload has
// the checksum its header states; otherwise an error wrapping ErrCorrupt,
// ErrVersion, ErrFingerprint, ErrLayoutVersion or ErrKey. FuzzAccept
// checks that an accepted header re-encodes to the bytes read.
func Accept(hdr []byte, total int, sum func() uint32, fingerprint uint64, key [16]byte, n int) error {
	if total < HeaderSize {
		return fmt.Errorf("%w: %d bytes, shorter than the header sector", ErrCorrupt, total)
	}
	h, err := DecodeHeader(hdr)
	if err != nil {
		return err
	}
	if err := h.Check(fingerprint, HostLayoutVersion); err != nil {
		return err
	}
	if h.Key != key {
		return fmt.Errorf("%w: record of key %x, read for %x", ErrKey, h.Key, key)
	}
	if h.PayloadLen != uint64(n) || total != HeaderSize+n {
		return fmt.Errorf("%w: payload of %d bytes read, header says %d, reader wants %d", ErrCorrupt, total-HeaderSize, h.PayloadLen, n)
	}
	if got := sum(); got != h.PayloadSum {
		return fmt.Errorf("%w: payload checksum %08x, header says %08x", ErrCorrupt, got, h.PayloadSum)
	}
	return nil
}

// Stale reports whether err, from Accept, is a well-formed record that is
// not the reader's (another fingerprint, host-layout version or key)
// rather than damaged bytes.
func Stale(err error) bool {
	return errors.Is(err, ErrFingerprint) || errors.Is(err, ErrLayoutVersion) || errors.Is(err, ErrKey)
}
