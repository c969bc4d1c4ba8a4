package wire

import "fmt"

// reader walks a message; the first failure sticks.
type reader struct {
	b   []byte
	off int
	err error
}

func (r *reader) fail(what string) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: %s at byte %d of %d", ErrMalformed, what, r.off, len(r.b))
	}
}

func (r *reader) take(n int, what string) []byte {
	if r.err != nil {
		return nil
	}
	if n < 0 || n > len(r.b)-r.off {
		r.fail(what + ": past the end")
		return nil
	}
	p := r.b[r.off : r.off+n]
	r.off += n
	return p
}

func (r *reader) u8(what string) uint8 {
	if p := r.take(1, what); p != nil {
		return p[0]
	}
	return 0
}

func (r *reader) u16(what string) uint16 {
	if p := r.take(2, what); p != nil {
		return le.Uint16(p)
	}
	return 0
}

func (r *reader) u32(what string) uint32 {
	if p := r.take(4, what); p != nil {
		return le.Uint32(p)
	}
	return 0
}

func (r *reader) u64(what string) uint64 {
	if p := r.take(8, what); p != nil {
		return le.Uint64(p)
	}
	return 0
}

// count reads a list's length and checks it against limit and against the
// bytes left (each entry at least size bytes): only then may a caller
// allocate for it.
func (r *reader) count(limit, size int, what string) int {
	n := r.u32(what + " count")
	if r.err != nil {
		return 0
	}
	if int64(n) > int64(limit) {
		r.fail(fmt.Sprintf("%s count %d over its cap of %d", what, n, limit))
		return 0
	}
	if int64(n)*int64(size) > int64(len(r.b)-r.off) {
		r.fail(fmt.Sprintf("%s count %d needs %d bytes, %d left", what, n, int64(n)*int64(size), len(r.b)-r.off))
		return 0
	}
	return int(n)
}

func (r *reader) str(what string) string {
	n := r.u16(what + " length")
	if int(n) > MaxString {
		r.fail(fmt.Sprintf("%s of %d bytes over its cap of %d", what, n, MaxString))
		return ""
	}
	return string(r.take(int(n), what))
}

func (r *reader) keys(dst []Key, what string) []Key {
	n := r.count(MaxKeys, 16, what)
	dst = dst[:0]
	if r.err != nil {
		return dst
	}
	p := r.take(16*n, what)
	if r.err != nil {
		return dst
	}
	dst = grow(dst, n)
	for i := range dst {
		copy(dst[i][:], p[16*i:16*i+16])
	}
	return dst
}

func (r *reader) slots(dst []Slot) []Slot {
	n := r.count(MaxKeys, 20, "slots")
	p := r.take(20*n, "slots")
	if r.err != nil {
		return dst[:0]
	}
	dst = grow(dst, n)
	for i := range dst {
		q := p[20*i : 20*i+20]
		dst[i] = Slot{ID: le.Uint32(q), Gen: le.Uint32(q[4:]), Region: le.Uint32(q[8:]), Off: le.Uint64(q[12:])}
	}
	return dst
}

func (r *reader) handles(dst []Handle) []Handle {
	n := r.count(MaxKeys, 8, "handles")
	p := r.take(8*n, "handles")
	if r.err != nil {
		return dst[:0]
	}
	dst = grow(dst, n)
	for i := range dst {
		q := p[8*i : 8*i+8]
		dst[i].ID, dst[i].Gen = le.Uint32(q), le.Uint32(q[4:])
	}
	return dst
}

// grow returns s resized to n entries, reusing its memory when it can (n
// was checked against the message's length by count).
func grow[T any](s []T, n int) []T {
	if cap(s) < n {
		return make([]T, n)
	}
	return s[:n]
}

// Decode decodes one whole message b into m, reusing m's slices. Errors
// wrap ErrMalformed; b must be exactly one message (trailing bytes are an
// error). What it allocates is bounded by len(b) (see the package comment);
// strings and JSON are copied out of b.
func Decode(b []byte, m *Msg) error {
	m.Reset()
	if len(b) > MaxMessage {
		return fmt.Errorf("%w: %d bytes, at most %d", ErrMalformed, len(b), MaxMessage)
	}
	r := reader{b: b}
	h := r.take(HeaderLen, "header")
	if r.err != nil {
		return r.err
	}
	m.Type, m.Flags, m.ReqID = Type(h[0]), h[1], le.Uint32(h[4:])
	if h[2] != 0 || h[3] != 0 {
		r.fail("reserved header bytes not zero")
	}
	switch m.Type {
	case THello:
		if r.u32("magic") != Magic && r.err == nil {
			r.fail("bad magic")
		}
		m.Version = r.u16("version")
		m.Namespace = r.str("namespace")
		m.Layout.Kind = r.u8("layout kind")
		m.Layout.Layers = r.u32("layers")
		m.Layout.KVHeads = r.u32("kv heads")
		m.Layout.HeadDim = r.u32("head dim")
		m.Layout.DTypeBytes = r.u32("dtype bytes")
		m.Layout.TokensPerBlock = r.u32("tokens per block")
	case THelloOK:
		m.Version = r.u16("version")
		m.ClientID = r.u32("client id")
		m.NamespaceID = r.u32("namespace id")
		m.SlotSize = r.u64("slot size")
		m.Regions = r.u32("regions")
		m.Text = r.str("page mode")
	case TError:
		m.Code = r.u16("code")
		m.Text = r.str("text")
	case TOK, TTrim:
		m.N = r.u64("n")
	case TLookup, TBeginLoad, TDelete:
		m.Keys = r.keys(m.Keys, "keys")
	case TLookupOK:
		m.N = r.u64("hits")
		m.Slots = r.slots(m.Slots)
		m.Lower = r.u32("lower-tier hits")
		if r.err == nil && (m.N > MaxKeys || (len(m.Slots) != 0 && uint64(len(m.Slots)) != m.N)) {
			r.fail(fmt.Sprintf("%d hits with %d leased slots", m.N, len(m.Slots)))
		}
		if r.err == nil && m.N+uint64(m.Lower) > MaxKeys {
			r.fail(fmt.Sprintf("%d hits and %d lower-tier hits, over %d keys", m.N, m.Lower, MaxKeys))
		}
	case TUnlease, TCommitStore, TAbortStore, TEndLoad:
		m.Handles = r.handles(m.Handles)
	case TBeginStore:
		m.HeadLo = r.u16("head lo")
		m.HeadHi = r.u16("head hi")
		if m.Flags&FlagChain != 0 {
			copy(m.Parent[:], r.take(16, "parent"))
		} else {
			m.Parents = r.keys(m.Parents, "parents")
		}
		m.Keys = r.keys(m.Keys, "keys")
		if r.err == nil && m.Flags&FlagChain == 0 && len(m.Parents) != len(m.Keys) {
			r.fail(fmt.Sprintf("%d parents for %d keys", len(m.Parents), len(m.Keys)))
		}
	case TPromote:
		m.Parents = r.keys(m.Parents, "parents")
		m.Keys = r.keys(m.Keys, "keys")
		if r.err == nil && len(m.Parents) != len(m.Keys) {
			r.fail(fmt.Sprintf("%d parents for %d keys", len(m.Parents), len(m.Keys)))
		}
	case TBeginStoreOK, TBeginLoadOK:
		n := r.count(MaxKeys, 1, "outcomes")
		m.Outcomes = append(m.Outcomes, r.take(n, "outcomes")...)
		m.Slots = r.slots(m.Slots)
		want := 0
		for _, o := range m.Outcomes {
			if o == 0 || o > maxOutcome {
				r.fail(fmt.Sprintf("outcome %d", o))
				break
			}
			if o == OutcomeWrite || o == OutcomeFound {
				want++
			}
		}
		if r.err == nil && want != len(m.Slots) {
			r.fail(fmt.Sprintf("%d slots for %d reserved or found keys", len(m.Slots), want))
		}
	case TStatsOK, TTrimOK:
		n := r.count(MaxJSON, 1, "json")
		m.JSON = append(m.JSON, r.take(n, "json")...)
	case TRetireAck, TRegionRetire:
		m.Region.ID = r.u32("region id")
	case TRegionAdded:
		m.Region.ID = r.u32("region id")
		m.Region.Size = r.u64("region size")
	case TEvents:
		n := r.count(MaxKeys, 21, "events")
		for i := 0; i < n && r.err == nil; i++ {
			e := Event{Kind: r.u8("event kind"), NS: r.u32("event namespace")}
			copy(e.Key[:], r.take(16, "event key"))
			m.Events = append(m.Events, e)
		}
	case TClear, TStats, TSubscribe, TBye:
	default:
		r.fail(fmt.Sprintf("unknown type %d", h[0]))
	}
	if r.err == nil && r.off != len(b) {
		r.fail(fmt.Sprintf("%d trailing bytes after %v", len(b)-r.off, m.Type))
	}
	return r.err
}
