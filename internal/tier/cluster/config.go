package cluster

import (
	"crypto/tls"
	"errors"
	"time"
)

// Config describes a Store.
type Config struct {
	// Addrs are some of the cluster's nodes, host:port; the client learns the
	// rest from them.
	Addrs []string
	// Username and Password are sent with AUTH (an ACL user, or the default
	// user's requirepass when Username is empty). Empty: no AUTH.
	Username string
	Password string
	// TLS, when set, is used for every connection.
	TLS *tls.Config
	// Prefix opens every key (default "kvo").
	Prefix string
	// Namespace names the records' namespace in keys; required. Clear bumps
	// its generation.
	Namespace string
	// Fingerprint is record.Fingerprint of the writer's geometry: records of
	// another fingerprint are misses.
	Fingerprint uint64
	// TTL is every record's time to live (default 1h, at least 1ms).
	TTL time.Duration
	// MaxInFlightBytes bounds the bytes of records (header and payload)
	// PutAsync has accepted that the cluster has not yet answered
	// (default 256 MiB).
	MaxInFlightBytes int64
	// Timeout bounds each put and each Get (whichever of it and Get's context
	// deadline comes first), and dials (default 1s).
	Timeout time.Duration
	// ConnsPerNode is the number of pipelined connections to each node, a
	// power of two up to 256 (default 2).
	ConnsPerNode int
	// Streams bounds the records Get reads at once, store-wide, each on a
	// connection of its own (default 32); when the slot map is known they
	// are shared out evenly among the masters, rounded up (slots.go).
	Streams int
	// GenerationRefresh is how often the namespace's generation is re-read
	// from the cluster (default 1s; negative: never, only at Open and Clear).
	GenerationRefresh time.Duration
	// Background makes a cluster that does not answer at Open no error:
	// Open returns a store that is not Available and connects in the
	// background (see Open).
	Background bool
	// ReconnectMin and ReconnectMax bound the wait between two connect
	// attempts in the background: the first waits ReconnectMin (default
	// 100ms), each later one twice the one before, up to ReconnectMax
	// (default 5s).
	ReconnectMin, ReconnectMax time.Duration
	// OnPutDone, when set, is called once for each put PutAsync accepted,
	// when it completed (ok: the cluster stored it). It runs on its own
	// goroutine and must not block for long; a goroutine it starts counts
	// as the store's (Close waits for it). The put's bytes no longer count
	// against MaxInFlightBytes when it is called (a PutAsync from it has
	// that room). Flush returns only after the callbacks of the puts it
	// waited for have returned (so a callback must not call Flush).
	OnPutDone func(key [16]byte, ok bool)

	// faults, set only by this package's tests, injects errors.
	faults *faults
}

// Errors. Every error of this package wraps one of these or the client's.
var (
	// ErrConfig: a Config field out of range (named in the message).
	ErrConfig = errors.New("cluster: invalid config")
	// ErrClosed: the store was closed.
	ErrClosed = errors.New("cluster: store closed")
)

// faults is the tests' fault seam: fn runs before each operation and a
// non-nil error replaces the operation's result.
type faults struct {
	fn func(op faultOp) error
}

type faultOp uint8

const (
	opPut faultOp = iota // one record's SET
	opGet                // one Get batch
)

func (f *faults) inject(op faultOp) error {
	if f == nil || f.fn == nil {
		return nil
	}
	return f.fn(op)
}
