package wire

import (
	"errors"
	"net"
	"os"
	"reflect"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"
)

func key(i int) Key { return Key{byte(i), byte(i >> 8), 7} }

func samples() []Msg {
	keys := []Key{key(1), key(2), key(3)}
	return []Msg{
		{Type: THello, ReqID: 1, Version: Version, Namespace: "llama", Layout: Layout{Kind: 1, Layers: 32, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, TokensPerBlock: 16}},
		{Type: THelloOK, ReqID: 1, Version: Version, ClientID: 3, NamespaceID: 1, SlotSize: 2 << 20, Regions: 4, Text: "thp"},
		{Type: TError, ReqID: 9, Code: CodeVersion, Text: "version 2, node speaks 1"},
		{Type: TOK, ReqID: 2, N: 5},
		{Type: TLookup, ReqID: 3, Flags: FlagLease, Keys: keys},
		{Type: TLookupOK, ReqID: 3, N: 2, Slots: []Slot{{1, 2, 3, 4096}, {5, 6, 7, 8192}}},
		{Type: TUnlease, ReqID: 4, Handles: []Handle{{1, 2}}},
		{Type: TBeginStore, ReqID: 5, Flags: FlagChain, HeadLo: 0, HeadHi: 8, Parent: key(9), Keys: keys},
		{Type: TBeginStore, ReqID: 5, HeadHi: 8, Parents: []Key{{}, key(1), key(2)}, Keys: keys},
		{Type: TBeginStoreOK, ReqID: 5, Outcomes: []uint8{OutcomeWrite, OutcomePresent, OutcomeRefusedFull}, Slots: []Slot{{1, 1, 1, 0}}},
		{Type: TCommitStore, ReqID: 6, Handles: []Handle{{1, 1}, {2, 1}}},
		{Type: TAbortStore, ReqID: 6, Handles: []Handle{{1, 1}}},
		{Type: TBeginLoad, ReqID: 7, Keys: keys},
		{Type: TBeginLoadOK, ReqID: 7, Outcomes: []uint8{OutcomeFound, OutcomeMissing}, Slots: []Slot{{4, 4, 4, 4}}},
		{Type: TBeginLoad, ReqID: 7, Flags: FlagDiskLater, Keys: keys},
		{Type: TBeginLoadOK, ReqID: 7, Outcomes: []uint8{OutcomeFound, OutcomeOnDisk, OutcomeMissing}, Slots: []Slot{{4, 4, 4, 4}}},
		{Type: TPromote, ReqID: 7, Parents: []Key{{}, key(1), key(9)}, Keys: keys},
		{Type: TEndLoad, ReqID: 8, Handles: []Handle{{4, 4}}},
		{Type: TDelete, ReqID: 8, Keys: keys[:1]},
		{Type: TClear, ReqID: 8},
		{Type: TStats, ReqID: 8},
		{Type: TStatsOK, ReqID: 8, JSON: []byte(`{"a":1}`)},
		{Type: TTrim, ReqID: 8, N: 1 << 30},
		{Type: TTrimOK, ReqID: 8, JSON: []byte(`{}`)},
		{Type: TRetireAck, ReqID: 8, Region: Region{ID: 3}},
		{Type: TSubscribe, ReqID: 8},
		{Type: TBye, ReqID: 8},
		{Type: TRegionAdded, Region: Region{ID: 2, Size: 1 << 30}},
		{Type: TRegionRetire, Region: Region{ID: 2}},
		{Type: TEvents, Events: []Event{{EventStored, 1, key(1)}, {EventRemoved, 2, key(2)}}},
	}
}

// norm makes empty slices nil so that DeepEqual compares contents.
func norm(m Msg) Msg {
	if len(m.Keys) == 0 {
		m.Keys = nil
	}
	if len(m.Parents) == 0 {
		m.Parents = nil
	}
	if len(m.Handles) == 0 {
		m.Handles = nil
	}
	if len(m.Slots) == 0 {
		m.Slots = nil
	}
	if len(m.Outcomes) == 0 {
		m.Outcomes = nil
	}
	if len(m.Events) == 0 {
		m.Events = nil
	}
	if len(m.JSON) == 0 {
		m.JSON = nil
	}
	return m
}

func TestRoundTrip(t *testing.T) {
	var got Msg
	for _, m := range samples() {
		b, err := Encode(nil, &m)
		if err != nil {
			t.Fatalf("%v: %v", m.Type, err)
		}
		if err := Decode(b, &got); err != nil {
			t.Fatalf("%v: %v", m.Type, err)
		}
		if !reflect.DeepEqual(norm(got), norm(m)) {
			t.Fatalf("%v: got %+v want %+v", m.Type, got, m)
		}
		// Every strict prefix is malformed, as is one trailing byte.
		for i := 0; i < len(b); i++ {
			if err := Decode(b[:i], &got); !errors.Is(err, ErrMalformed) {
				t.Fatalf("%v cut at %d: %v", m.Type, i, err)
			}
		}
		if err := Decode(append(b, 0), &got); !errors.Is(err, ErrMalformed) {
			t.Fatalf("%v with a trailing byte: %v", m.Type, err)
		}
	}
}

func TestBounds(t *testing.T) {
	keys := make([]Key, MaxKeys+1)
	if _, err := Encode(nil, &Msg{Type: TLookup, Keys: keys}); !errors.Is(err, ErrMalformed) {
		t.Fatalf("MaxKeys+1 keys encoded: %v", err)
	}
	// A BeginStore of MaxKeys keys with their parents fits in MaxMessage.
	b, err := Encode(nil, &Msg{Type: TBeginStore, Keys: keys[:MaxKeys], Parents: keys[:MaxKeys]})
	if err != nil || len(b) > MaxMessage {
		t.Fatalf("full BeginStore: %d bytes, %v", len(b), err)
	}
	// A hostile count: 4 billion keys in a 12-byte message.
	hostile := []byte{byte(TLookup), 0, 0, 0, 1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff}
	var m Msg
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for i := 0; i < 100; i++ {
		_ = Decode(hostile, &m)
	}
	runtime.ReadMemStats(&after)
	if err := Decode(hostile, &m); !errors.Is(err, ErrMalformed) || cap(m.Keys) > MaxKeys {
		t.Fatalf("hostile count: %v, cap %d", err, cap(m.Keys))
	}
	// Only the error (its message) is allocated: well under 1 KiB a call.
	if per := (after.TotalAlloc - before.TotalAlloc) / 100; per > 1024 {
		t.Fatalf("hostile count allocated %d bytes a call", per)
	}
}

// FuzzDecode: no input panics Decode, none makes it allocate beyond a
// bound proportional to the input, and whatever decodes re-encodes to the
// same bytes (the encoding is canonical).
func FuzzDecode(f *testing.F) {
	for _, m := range samples() {
		b, _ := Encode(nil, &m)
		f.Add(b)
	}
	f.Add([]byte{byte(TBeginStoreOK), 0, 0, 0, 1, 0, 0, 0, 0xff, 0xff, 0xff, 0x7f})
	f.Fuzz(func(t *testing.T, b []byte) {
		var m Msg
		if err := Decode(b, &m); err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error not ErrMalformed: %v", err)
			}
			return
		}
		if n := cap(m.Keys) + cap(m.Parents) + cap(m.Handles) + cap(m.Slots) + cap(m.Outcomes) + cap(m.Events); n > 2*len(b)+64 {
			t.Fatalf("%d entries allocated for %d bytes", n, len(b))
		}
		out, err := Encode(nil, &m)
		if err != nil {
			t.Fatalf("decoded %v does not encode: %v", m.Type, err)
		}
		if string(out) != string(b) {
			t.Fatalf("%v re-encodes differently:\n%x\n%x", m.Type, b, out)
		}
	})
}

// TestConnSize: a connection of NewConnSize refuses a message longer than
// its receive size as truncated (and stays usable), and takes one of
// MaxMessage bytes after SetRecvSize.
func TestConnSize(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) *net.UnixConn {
		c, err := net.FileConn(os.NewFile(uintptr(fd), "sock"))
		if err != nil {
			t.Fatal(err)
		}
		return c.(*net.UnixConn)
	}
	a, b := NewConn(conn(fds[0])), NewConnSize(conn(fds[1]), 64)
	defer a.Close()
	defer b.Close()
	big := &Msg{Type: TStatsOK, ReqID: 1, JSON: make([]byte, 1000)}
	small := &Msg{Type: TStats, ReqID: 2}
	var m Msg
	for _, x := range []*Msg{big, small} {
		if err := a.Send(x, -1); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := b.Recv(&m); !errors.Is(err, ErrMalformed) {
		t.Fatalf("1000 bytes into 64: %v", err)
	}
	if _, err := b.Recv(&m); err != nil || m.ReqID != 2 {
		t.Fatalf("the next message: %v %+v", err, m)
	}
	b.SetRecvSize()
	if err := a.Send(big, -1); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Recv(&m); err != nil || len(m.JSON) != 1000 {
		t.Fatalf("after SetRecvSize: %v", err)
	}
}
