// Package wire is the node pool's protocol: the messages a node
// (nodepool.Server) and its clients (nodepool.Client) exchange over a unix
// socket, their encoding, and the framing.
//
// # Framing
//
// The socket is SOCK_SEQPACKET, not SOCK_STREAM with a length prefix: the
// kernel keeps message boundaries, so one read is one whole message (or
// MSG_TRUNC, reported as an error), a reader never waits for the rest of a
// message a hostile peer never sends, and no length field can make a reader
// allocate: every buffer is MaxMessage bytes, allocated once per
// connection (a node's connection starts with a small receive buffer,
// NewConnSize, and takes the full one with its Hello). File descriptors passed with SCM_RIGHTS ride on exactly the
// message they belong to (RegionAdded), which a byte stream cannot promise.
// Delivery is reliable and ordered, as on a stream.
//
// # Messages
//
// Every message starts with an 8-byte header: type (1 byte), flags (1 byte),
// 2 reserved bytes (zero), request id (uint32). Integers are little-endian.
// A request (client to node) carries a nonzero request id and gets exactly
// one reply (same id): the op's reply type, or Error. Replies come in
// request order but for Promote's, which a node with a disk tier sends
// once its reads are done, after the replies of requests that came later:
// a client matches replies by request id. One request is one
// operation on a whole list of blocks: one round trip per op, never per
// block. Pushes (node to client: RegionAdded, RegionRetire, Events) carry
// request id 0.
//
// The first request on a connection must be Hello, carrying Version; a
// node answers another version with Error{CodeVersion} naming both
// versions, and closes the connection. Nothing else is accepted before
// HelloOK.
//
// # Bounds
//
// A message is at most MaxMessage bytes; a list at most MaxKeys entries; a
// string at most MaxString bytes. Decode checks every count against both its
// cap and the bytes left in the message before allocating, so what it
// allocates is bounded by the message's own length (at most MaxMessage) and
// never by a count a peer wrote. Decode reuses the slices of the Msg it
// fills, so a connection's steady state allocates nothing but the strings
// of the rare messages that carry one (Hello, Error).
package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"

	"github.com/kvoffload/kvoffload/kvcache"
)

// Version is the protocol version this package speaks. A change of any
// message's encoding changes it.
const Version uint16 = 3

// Magic opens every Hello: "KVON".
const Magic uint32 = 0x4e4f564b

// Bounds of one message (see the package comment).
const (
	// MaxMessage is the largest message in bytes. The largest a client
	// sends, a BeginStore of MaxKeys keys with one parent each, is
	// 8 + 4 + 8 + MaxKeys×32 bytes (128 KiB and 20 bytes); the largest
	// reply, a BeginStoreOK of MaxKeys reservations, 8 + 8 + MaxKeys×21.
	// Both fit the default unix socket buffer (net.core.wmem_default).
	MaxMessage = 160 << 10
	// MaxKeys is the most keys (or slot handles, or events) in one message.
	MaxKeys = 4096
	// MaxString is the longest string (namespace, error text).
	MaxString = 1024
	// MaxJSON is the longest JSON body (Stats, Trim replies).
	MaxJSON = 64 << 10
	// HeaderLen is the length of the fixed header.
	HeaderLen = 8
)

// ErrMalformed: a message that does not decode (short, unknown type,
// count over its cap or beyond the message, trailing bytes, bad Magic).
var ErrMalformed = errors.New("wire: malformed message")

// Key is a block key.
type Key = kvcache.Key

// Type is a message's type.
type Type uint8

// Message types. Requests (client to node) and their replies, then pushes.
const (
	THello        Type = iota + 1 // Version, Namespace, Layout
	THelloOK                      // Version, ClientID, NamespaceID, SlotSize, Regions, Text (page mode)
	TError                        // Code, Text
	TOK                           // N
	TLookup                       // Flags&FlagLease, Keys
	TLookupOK                     // N (hits), Slots (leased: the first N keys' slots), Lower (the node's disk holds the next Lower keys)
	TUnlease                      // Handles
	TBeginStore                   // Flags&FlagChain, HeadLo, HeadHi, Parent | Parents, Keys
	TBeginStoreOK                 // Outcomes (one per key), Slots (one per OutcomeWrite, in key order)
	TCommitStore                  // Handles
	TAbortStore                   // Handles
	TBeginLoad                    // Flags&FlagDiskLater, Keys
	TBeginLoadOK                  // Outcomes (OutcomeFound, OutcomeMissing or, with FlagDiskLater, OutcomeOnDisk per key), Slots (one per found)
	TEndLoad                      // Handles
	TDelete                       // Keys → OK{N removed}
	TClear                        // → OK{N removed}: the client's namespace
	TStats                        // → StatsOK
	TStatsOK                      // JSON
	TTrim                         // N (bytes) → TrimOK
	TTrimOK                       // JSON
	TRetireAck                    // Region.ID → OK
	TSubscribe                    // → OK; Events pushes follow
	TBye                          // → OK; the client vouches no copy of it is in flight
	TRegionAdded                  // push: Region, one fd attached
	TRegionRetire                 // push: Region.ID
	TEvents                       // push: Events
	TPromote                      // Parents, Keys → BeginLoadOK: promote from the node's disk, then BeginLoad (version 3)
	numTypes
)

var typeNames = [numTypes]string{"", "Hello", "HelloOK", "Error", "OK", "Lookup", "LookupOK", "Unlease",
	"BeginStore", "BeginStoreOK", "CommitStore", "AbortStore", "BeginLoad", "BeginLoadOK", "EndLoad",
	"Delete", "Clear", "Stats", "StatsOK", "Trim", "TrimOK", "RetireAck", "Subscribe", "Bye",
	"RegionAdded", "RegionRetire", "Events", "Promote"}

func (t Type) String() string {
	if t > 0 && t < numTypes {
		return typeNames[t]
	}
	return fmt.Sprintf("Type(%d)", uint8(t))
}

// Flags.
const (
	FlagLease uint8 = 1 << 0 // Lookup: lease the hits
	FlagChain uint8 = 1 << 1 // BeginStore: Keys are one chain after Parent (no Parents list)
	// FlagDiskLater (BeginLoad): do not promote the keys the pool lacks
	// and the node's disk holds; report them OutcomeOnDisk (no slot), for
	// Promote requests of their own (version 3).
	FlagDiskLater uint8 = 1 << 2
)

// Store outcomes (BeginStoreOK) and load outcomes (BeginLoadOK), per key.
const (
	OutcomeWrite            uint8 = 1 // a slot was reserved to this client: copy, then CommitStore
	OutcomePresent          uint8 = 2 // already stored or being stored
	OutcomeRefusedFull      uint8 = 3
	OutcomeRefusedAdmission uint8 = 4
	OutcomeFound            uint8 = 5 // load: leased and counted as a transfer until EndLoad
	OutcomeMissing          uint8 = 6
	OutcomeOnDisk           uint8 = 7 // load with FlagDiskLater: not in the pool, on the node's disk (Promote it)
	maxOutcome                    = OutcomeOnDisk
)

// Error codes (Error.Code).
const (
	CodeMalformed   uint16 = 1 // the request did not decode
	CodeVersion     uint16 = 2 // Hello of another protocol version
	CodeLayout      uint16 = 3 // the namespace's layout differs (or the pool's slot size does)
	CodeHandshake   uint16 = 4 // a request before Hello, or Hello twice
	CodeInvalid     uint16 = 5 // bad arguments (duplicate key, unsupported head range...)
	CodeNotYours    uint16 = 6 // a handle this client holds no reservation or lease for
	CodeClosed      uint16 = 7 // the node is stopping
	CodeUnsupported uint16 = 8 // a feature this node does not have yet
	CodeInternal    uint16 = 9
)

// Layout is the geometry of a namespace's blocks: what must match between
// every client of a namespace (device addresses and GPU block counts are
// each client's own). Kind is kvcache.LayoutKind.
type Layout struct {
	Kind                                                 uint8
	Layers, KVHeads, HeadDim, DTypeBytes, TokensPerBlock uint32
}

// Slot is a reserved or leased slot as the node hands it out: ID and Gen
// name it (Handle), Region and Off locate it in the region's memfd.
type Slot struct {
	ID, Gen uint32
	Region  uint32
	Off     uint64
}

// Handle names a slot occupancy in requests that give it back.
type Handle struct{ ID, Gen uint32 }

// Handle returns the slot's handle.
func (s Slot) Handle() Handle { return Handle{s.ID, s.Gen} }

// Region describes a region of the pool: its id and size in bytes. The
// RegionAdded push carries its memfd.
type Region struct {
	ID   uint32
	Size uint64
}

// Event kinds.
const (
	EventStored  uint8 = 1 // a block became ready
	EventRemoved uint8 = 2 // a ready block left the index
)

// Event is one KV event: a block of namespace NS (the node's id, see
// HelloOK.NamespaceID) became ready or left the index.
type Event struct {
	Kind uint8
	NS   uint32
	Key  Key
}

// Msg is any message; which fields a type uses is listed at its constant.
// Decode reuses its slices.
type Msg struct {
	Type  Type
	Flags uint8
	ReqID uint32

	Version     uint16
	Namespace   string
	Layout      Layout
	ClientID    uint32
	NamespaceID uint32
	SlotSize    uint64
	Regions     uint32

	Code  uint16
	Text  string
	N     uint64
	Lower uint32

	HeadLo, HeadHi uint16
	Parent         Key
	Keys           []Key
	Parents        []Key
	Handles        []Handle
	Slots          []Slot
	Outcomes       []uint8
	Region         Region
	Events         []Event
	JSON           []byte
}

// Reset clears m, keeping its slices' memory.
func (m *Msg) Reset() {
	*m = Msg{Keys: m.Keys[:0], Parents: m.Parents[:0], Handles: m.Handles[:0], Slots: m.Slots[:0],
		Outcomes: m.Outcomes[:0], Events: m.Events[:0], JSON: m.JSON[:0]}
}

// Error is a node's Error reply as a Go error.
type Error struct {
	Code uint16
	Text string
}

func (e *Error) Error() string { return fmt.Sprintf("node: %s (code %d)", e.Text, e.Code) }

var le = binary.LittleEndian

// Append encodes m after dst. It does not check bounds: Encode does.
func Append(dst []byte, m *Msg) []byte {
	dst = append(dst, byte(m.Type), m.Flags, 0, 0)
	dst = le.AppendUint32(dst, m.ReqID)
	switch m.Type {
	case THello:
		dst = le.AppendUint32(dst, Magic)
		dst = le.AppendUint16(dst, m.Version)
		dst = appendString(dst, m.Namespace)
		dst = append(dst, m.Layout.Kind)
		for _, v := range [...]uint32{m.Layout.Layers, m.Layout.KVHeads, m.Layout.HeadDim, m.Layout.DTypeBytes, m.Layout.TokensPerBlock} {
			dst = le.AppendUint32(dst, v)
		}
	case THelloOK:
		dst = le.AppendUint16(dst, m.Version)
		dst = le.AppendUint32(dst, m.ClientID)
		dst = le.AppendUint32(dst, m.NamespaceID)
		dst = le.AppendUint64(dst, m.SlotSize)
		dst = le.AppendUint32(dst, m.Regions)
		dst = appendString(dst, m.Text)
	case TError:
		dst = le.AppendUint16(dst, m.Code)
		dst = appendString(dst, m.Text)
	case TOK, TTrim:
		dst = le.AppendUint64(dst, m.N)
	case TLookup, TBeginLoad, TDelete:
		dst = appendKeys(dst, m.Keys)
	case TLookupOK:
		dst = le.AppendUint64(dst, m.N)
		dst = appendSlots(dst, m.Slots)
		dst = le.AppendUint32(dst, m.Lower)
	case TUnlease, TCommitStore, TAbortStore, TEndLoad:
		dst = appendHandles(dst, m.Handles)
	case TBeginStore:
		dst = le.AppendUint16(dst, m.HeadLo)
		dst = le.AppendUint16(dst, m.HeadHi)
		if m.Flags&FlagChain != 0 {
			dst = append(dst, m.Parent[:]...)
		} else {
			dst = appendKeys(dst, m.Parents)
		}
		dst = appendKeys(dst, m.Keys)
	case TPromote:
		dst = appendKeys(dst, m.Parents)
		dst = appendKeys(dst, m.Keys)
	case TBeginStoreOK, TBeginLoadOK:
		dst = le.AppendUint32(dst, uint32(len(m.Outcomes)))
		dst = append(dst, m.Outcomes...)
		dst = appendSlots(dst, m.Slots)
	case TStatsOK, TTrimOK:
		dst = le.AppendUint32(dst, uint32(len(m.JSON)))
		dst = append(dst, m.JSON...)
	case TRetireAck, TRegionRetire:
		dst = le.AppendUint32(dst, m.Region.ID)
	case TRegionAdded:
		dst = le.AppendUint32(dst, m.Region.ID)
		dst = le.AppendUint64(dst, m.Region.Size)
	case TEvents:
		dst = le.AppendUint32(dst, uint32(len(m.Events)))
		for _, e := range m.Events {
			dst = append(dst, e.Kind)
			dst = le.AppendUint32(dst, e.NS)
			dst = append(dst, e.Key[:]...)
		}
	}
	return dst
}

// Encode is Append that checks m against the bounds Decode enforces, so
// that a peer never receives a message it must refuse.
func Encode(dst []byte, m *Msg) ([]byte, error) {
	if m.Type == 0 || m.Type >= numTypes {
		return dst, fmt.Errorf("%w: type %d", ErrMalformed, m.Type)
	}
	for _, n := range [...]int{len(m.Keys), len(m.Parents), len(m.Handles), len(m.Slots), len(m.Outcomes), len(m.Events)} {
		if n > MaxKeys {
			return dst, fmt.Errorf("%w: %d entries in one %v, at most %d", ErrMalformed, n, m.Type, MaxKeys)
		}
	}
	if len(m.Namespace) > MaxString || len(m.Text) > MaxString || len(m.JSON) > MaxJSON {
		return dst, fmt.Errorf("%w: a string of %v is over its cap", ErrMalformed, m.Type)
	}
	if (m.Type == TBeginStore && m.Flags&FlagChain == 0 || m.Type == TPromote) && len(m.Parents) != len(m.Keys) {
		return dst, fmt.Errorf("%w: %d parents for %d keys", ErrMalformed, len(m.Parents), len(m.Keys))
	}
	start := len(dst)
	dst = Append(dst, m)
	if len(dst)-start > MaxMessage {
		return dst[:start], fmt.Errorf("%w: %v of %d bytes, at most %d", ErrMalformed, m.Type, len(dst)-start, MaxMessage)
	}
	return dst, nil
}

func appendString(dst []byte, s string) []byte {
	dst = le.AppendUint16(dst, uint16(len(s)))
	return append(dst, s...)
}

func appendKeys(dst []byte, keys []Key) []byte {
	dst = le.AppendUint32(dst, uint32(len(keys)))
	dst = slices.Grow(dst, 16*len(keys))
	for i := range keys {
		dst = append(dst, keys[i][:]...)
	}
	return dst
}

func appendSlots(dst []byte, slots []Slot) []byte {
	dst = le.AppendUint32(dst, uint32(len(slots)))
	n := len(dst)
	dst = slices.Grow(dst, 20*len(slots))[:n+20*len(slots)]
	for i, s := range slots {
		q := dst[n+20*i : n+20*i+20]
		le.PutUint32(q, s.ID)
		le.PutUint32(q[4:], s.Gen)
		le.PutUint32(q[8:], s.Region)
		le.PutUint64(q[12:], s.Off)
	}
	return dst
}

func appendHandles(dst []byte, hs []Handle) []byte {
	dst = le.AppendUint32(dst, uint32(len(hs)))
	n := len(dst)
	dst = slices.Grow(dst, 8*len(hs))[:n+8*len(hs)]
	for i := range hs {
		q := dst[n+8*i : n+8*i+8]
		le.PutUint32(q, hs[i].ID)
		le.PutUint32(q[4:], hs[i].Gen)
	}
	return dst
}
