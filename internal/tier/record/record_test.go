package record

import (
	"bytes"
	"encoding/binary"
	"hash/crc32"
	"testing"

	"github.com/stretchr/testify/require"
)

func sample() Header {
	return Header{
		LayoutVersion: HostLayoutVersion,
		Fingerprint:   0x0123456789abcdef,
		Key:           [16]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16},
		PayloadLen:    2 << 20,
		PayloadSum:    0xdeadbeef,
	}
}

func TestHeaderRoundTrip(t *testing.T) {
	buf := make([]byte, HeaderSize)
	for i := range buf {
		buf[i] = 0xff
	}
	h := sample()
	EncodeHeader(buf, h)
	require.Equal(t, make([]byte, HeaderSize-60), buf[60:], "the rest of the sector is zeroed")
	got, err := DecodeHeader(buf)
	require.NoError(t, err)
	h.Version = FormatVersion
	require.Equal(t, h, got)
	require.NoError(t, got.Check(h.Fingerprint, HostLayoutVersion))

	short := make([]byte, HeaderLen)
	EncodeHeader(short, h)
	got, err = DecodeHeader(short)
	require.NoError(t, err)
	require.Equal(t, h, got)
}

func TestDecodeHeaderRejects(t *testing.T) {
	good := make([]byte, HeaderSize)
	EncodeHeader(good, sample())
	// reseal recomputes the header checksum, for a field changed on purpose.
	reseal := func(b []byte) {
		binary.LittleEndian.PutUint32(b[offHeaderSum:], crc32.Checksum(b[:offHeaderSum], castagnoli))
	}
	cases := []struct {
		name   string
		mutate func(b []byte) []byte
		want   error
	}{
		{"short", func(b []byte) []byte { return b[:HeaderLen-1] }, ErrCorrupt},
		{"zero sector", func(b []byte) []byte { return make([]byte, HeaderSize) }, ErrCorrupt},
		{"magic", func(b []byte) []byte { b[0] ^= 1; reseal(b); return b }, ErrCorrupt},
		{"flipped key byte", func(b []byte) []byte { b[offKey+3] ^= 0x10; return b }, ErrCorrupt},
		{"flipped length", func(b []byte) []byte { b[offPayloadLen] ^= 1; return b }, ErrCorrupt},
		{"flipped checksum", func(b []byte) []byte { b[offHeaderSum] ^= 1; return b }, ErrCorrupt},
		{"length bound", func(b []byte) []byte {
			binary.LittleEndian.PutUint64(b[offPayloadLen:], MaxPayloadBytes+1)
			reseal(b)
			return b
		}, ErrCorrupt},
		// Byte 60 is after the header checksum and outside it: the bytes
		// FuzzAccept found accepted but not re-encoding to themselves.
		{"byte after the header checksum", func(b []byte) []byte { b[offHeaderSum+4] = 1; return b }, ErrCorrupt},
		{"reserved after the version", func(b []byte) []byte { b[offVersion+3] = 1; reseal(b); return b }, ErrCorrupt},
		{"reserved after the payload checksum", func(b []byte) []byte { b[offPayloadSum+5] = 1; reseal(b); return b }, ErrCorrupt},
		{"older version", func(b []byte) []byte {
			binary.LittleEndian.PutUint16(b[offVersion:], FormatVersion-1)
			reseal(b)
			return b
		}, ErrVersion},
		{"newer version", func(b []byte) []byte {
			binary.LittleEndian.PutUint16(b[offVersion:], FormatVersion+1)
			reseal(b)
			return b
		}, ErrVersion},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := append([]byte(nil), good...)
			_, err := DecodeHeader(tc.mutate(b))
			require.ErrorIs(t, err, tc.want)
		})
	}
}

func TestCheck(t *testing.T) {
	h := sample()
	require.ErrorIs(t, h.Check(h.Fingerprint+1, HostLayoutVersion), ErrFingerprint)
	require.ErrorIs(t, h.Check(h.Fingerprint, HostLayoutVersion+1), ErrLayoutVersion)
}

func TestVerifyPayload(t *testing.T) {
	p := make([]byte, 8192)
	for i := range p {
		p[i] = byte(i * 7)
	}
	h := sample()
	h.PayloadLen = uint64(len(p))
	h.PayloadSum = Checksum(p)
	require.NoError(t, VerifyPayload(h, p))
	require.ErrorIs(t, VerifyPayload(h, p[:len(p)-1]), ErrCorrupt)
	p[4000] ^= 0x40
	require.ErrorIs(t, VerifyPayload(h, p), ErrCorrupt)
}

func TestFingerprint(t *testing.T) {
	base := Geometry{Namespace: []byte("llama-3-8b"), KVHeads: 8, Layers: 32, HeadDim: 128,
		DTypeBytes: 2, TokensPerBlock: 16, LayoutKind: 1, DType: "bf16"}
	require.Equal(t, Fingerprint(base), Fingerprint(base), "deterministic")
	variants := []func(g *Geometry){
		func(g *Geometry) { g.Namespace = []byte("llama-3-8b-lora") },
		func(g *Geometry) { g.KVHeads = 4 },
		func(g *Geometry) { g.Layers = 31 },
		func(g *Geometry) { g.HeadDim = 64 },
		func(g *Geometry) { g.DTypeBytes = 1 },
		func(g *Geometry) { g.TokensPerBlock = 32 },
		func(g *Geometry) { g.LayoutKind = 2 },
		func(g *Geometry) { g.DType = "fp16" },
		// Length prefixes: moving bytes between namespace and dtype changes it.
		func(g *Geometry) { g.Namespace = []byte("llama-3-8bb"); g.DType = "f16" },
	}
	seen := map[uint64]int{Fingerprint(base): -1}
	for i, v := range variants {
		g := base
		v(&g)
		fp := Fingerprint(g)
		prev, dup := seen[fp]
		require.False(t, dup, "variant %d has the fingerprint of %d", i, prev)
		seen[fp] = i
	}
}

func TestDecodeHeaderDoesNotAllocate(t *testing.T) {
	good := make([]byte, HeaderSize)
	EncodeHeader(good, sample())
	allocs := testing.AllocsPerRun(100, func() {
		if _, err := DecodeHeader(good); err != nil {
			panic(err)
		}
	})
	require.Zero(t, allocs)
}

// FuzzDecodeHeader: DecodeHeader never panics on any input, allocates nothing
// on success whatever the length field says, and what it accepts encodes back
// to the same fields.
func FuzzDecodeHeader(f *testing.F) {
	good := make([]byte, HeaderLen)
	EncodeHeader(good, sample())
	f.Add(good)
	f.Add(make([]byte, HeaderLen))
	f.Add(good[:HeaderLen-1])
	big := append([]byte(nil), good...)
	binary.LittleEndian.PutUint64(big[offPayloadLen:], ^uint64(0))
	binary.LittleEndian.PutUint32(big[offHeaderSum:], crc32.Checksum(big[:offHeaderSum], castagnoli))
	f.Add(big)
	f.Fuzz(func(t *testing.T, src []byte) {
		h, err := DecodeHeader(src)
		if err != nil {
			return
		}
		if h.PayloadLen > MaxPayloadBytes || h.Version != FormatVersion {
			t.Fatalf("accepted %+v", h)
		}
		if a := testing.AllocsPerRun(1, func() { _, _ = DecodeHeader(src) }); a != 0 {
			t.Fatalf("DecodeHeader allocated %v times for payload length %d", a, h.PayloadLen)
		}
		out := make([]byte, HeaderLen)
		EncodeHeader(out, h)
		again, err := DecodeHeader(out)
		if err != nil || again != h {
			t.Fatalf("re-encoded %+v decoded as %+v, %v", h, again, err)
		}
	})
}

// FuzzAccept: whatever bytes a reader got for key into n bytes, Accept
// accepts only exactly key's record of n payload bytes under the reader's
// fingerprint: the bytes are the header sector and n bytes, the header
// re-encodes to the bytes read, and the payload has the stated checksum.
// A stale verdict (Stale) is given only to a well-formed header. Seeded
// with valid records, which the fuzzer mutates.
func FuzzAccept(f *testing.F) {
	const fp = 0x0123456789abcdef
	rec := func(key [16]byte, payload []byte) []byte {
		v := make([]byte, HeaderSize+len(payload))
		EncodeHeader(v, Header{LayoutVersion: HostLayoutVersion, Fingerprint: fp, Key: key,
			PayloadLen: uint64(len(payload)), PayloadSum: Checksum(payload)})
		copy(v[HeaderSize:], payload)
		return v
	}
	key := [16]byte{9, 8, 7}
	f.Add(rec(key, []byte("a payload of some bytes")), key[:], 23)
	f.Add(rec(key, nil), key[:], 0)
	f.Add(rec(key, bytes.Repeat([]byte{1}, 300)), []byte{9, 8}, 300)
	f.Fuzz(func(t *testing.T, v, keyBytes []byte, n int) {
		if n < 0 || n > 1<<16 || len(v) > 1<<17 {
			return
		}
		var k [16]byte
		copy(k[:], keyBytes)
		summed := false
		err := Accept(v, len(v), func() uint32 { summed = true; return Checksum(v[HeaderSize:]) }, fp, k, n)
		if err != nil {
			if Stale(err) {
				if _, derr := DecodeHeader(v); derr != nil {
					t.Fatalf("stale verdict %v on a header that does not decode: %v", err, derr)
				}
			}
			return
		}
		if !summed || len(v) != HeaderSize+n {
			t.Fatalf("accepted %d bytes for %d payload bytes (checksum computed: %v)", len(v), n, summed)
		}
		h, derr := DecodeHeader(v)
		if derr != nil || h.Key != k || h.Fingerprint != fp || h.LayoutVersion != HostLayoutVersion || h.PayloadLen != uint64(n) || h.PayloadSum != Checksum(v[HeaderSize:]) {
			t.Fatalf("accepted a record that is not key %x's of %d bytes: %+v, %v", k, n, h, derr)
		}
		again := make([]byte, HeaderLen)
		EncodeHeader(again, h)
		if !bytes.Equal(again, v[:HeaderLen]) {
			t.Fatalf("an accepted header does not re-encode to itself")
		}
	})
}
