package offload

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/kvoffload/kvoffload/internal/tier/cluster"
	"github.com/kvoffload/kvoffload/kvcache"
)

// ClusterConfig turns on the cluster tier, a shared Redis Cluster: Prefetch
// promotes from it what every Store writes through.
type ClusterConfig struct {
	Addrs            []string      `json:"addrs"`              // some of the nodes, host:port; required
	Username         string        `json:"username,omitempty"` // Username and Password: sent with AUTH if set
	Password         string        `json:"password,omitempty"`
	TLS              bool          `json:"tls,omitempty"`                 // also on with either of the next two
	TLSCAFile        string        `json:"tls_ca_file,omitempty"`         // PEM: the authorities to trust, not the system's
	TLSServerName    string        `json:"tls_server_name,omitempty"`     // checked instead of each address's host
	Prefix           string        `json:"prefix,omitempty"`              // of every key (default "kvo")
	TTL              time.Duration `json:"ttl,omitempty"`                 // of every record (default 1h, at least 1ms)
	MaxInFlightBytes int64         `json:"max_in_flight_bytes,omitempty"` // unanswered writes; past it one is dropped (256 MiB)
	Timeout          time.Duration `json:"timeout,omitempty"`             // of each write, dial and Prefetch wait (1s)
}

// PrefetchOptions modify Prefetch.
type PrefetchOptions struct {
	Timeout time.Duration  // then what has not come is a miss (0: none for disk; the cluster's at most)
	Policy  PrefetchPolicy // default PrefetchWait
}

// PrefetchPolicy says whether Prefetch waits for its promotions.
type PrefetchPolicy uint8

// PrefetchWait returns once done; PrefetchBestEffort at once, promoting in
// the background, up to MaxBackgroundPrefetches calls at a time.
const (
	PrefetchWait PrefetchPolicy = iota
	PrefetchBestEffort
	MaxBackgroundPrefetches = 4
)

// PrefetchResult is what Prefetch promoted into the host pool.
type PrefetchResult struct {
	Promoted, FromDisk, FromCluster int  // blocks made ready; Promoted = FromDisk + FromCluster
	Background                      bool // started in the background; the counts are then 0
}

// errClusterMiss fails the stores of promoted blocks the cluster did not
// deliver.
var errClusterMiss = errors.New("offload: cluster record missing, damaged or late")

// clusterDefaults checks cfg.Cluster and fills its defaults on a copy.
//
// How the tier behaves, beyond ClusterConfig's doc: a write-through copies
// the slot's bytes on the tier's goroutine while the slot is leased (it
// counts in Stats.Pool.BlocksLeased meanwhile); a cluster that does not
// answer is retried with a backoff up to 5s, its skipped work counted in
// Stats.Cluster.Unavailable. A background Prefetch does not keep ctx and
// Close cancels it: a disk read started is waited for, the cluster's
// answers are not.
func clusterDefaults(cfg *Config) error {
	if cfg.Cluster == nil {
		return nil
	}
	c := *cfg.Cluster
	c.Addrs = append([]string(nil), c.Addrs...)
	cfg.Cluster = &c
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: Cluster."+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	if len(c.Addrs) == 0 {
		return bad("Addrs is empty: name at least one node, host:port")
	}
	for _, a := range c.Addrs {
		if a == "" {
			return bad("Addrs %q: an empty address", c.Addrs)
		}
	}
	if c.Prefix == "" {
		c.Prefix = cluster.DefaultPrefix
	}
	switch {
	case c.TTL == 0:
		c.TTL = cluster.DefaultTTL
	case c.TTL < time.Millisecond:
		return bad("TTL = %v, must be at least 1ms", c.TTL)
	}
	switch {
	case c.MaxInFlightBytes == 0:
		c.MaxInFlightBytes = cluster.DefaultMaxInFlightBytes
	case c.MaxInFlightBytes < 0:
		return bad("MaxInFlightBytes = %d, must not be negative", c.MaxInFlightBytes)
	}
	switch {
	case c.Timeout == 0:
		c.Timeout = cluster.DefaultTimeout
	case c.Timeout < 0:
		return bad("Timeout = %v, must not be negative", c.Timeout)
	}
	return nil
}

// openCluster opens the cluster tier of cfg (New). A bad configuration is
// an error; a cluster that does not answer is not: the store connects in
// the background and is not Available meanwhile.
func (e *Engine) openCluster(cfg Config) error {
	cc := cfg.Cluster
	fp, err := recordFingerprint(cfg)
	if err != nil {
		return err
	}
	ccfg := cluster.Config{Addrs: cc.Addrs, Username: cc.Username, Password: cc.Password, Prefix: cc.Prefix,
		Namespace: cfg.Namespace, Fingerprint: fp, TTL: cc.TTL, MaxInFlightBytes: cc.MaxInFlightBytes, Timeout: cc.Timeout,
		Background: true,
		OnPutDone: func(key [16]byte, ok bool) {
			if ok {
				e.hub.onTier(EventStored, key, MediumSharedStorage)
			}
		}}
	if ccfg.Namespace == "" {
		ccfg.Namespace = "default" // the cluster's keys need one; the fingerprint covers the engine's
	}
	if cc.TLS || cc.TLSCAFile != "" || cc.TLSServerName != "" {
		tc, err := clusterTLS(cc)
		if err != nil {
			return err
		}
		ccfg.TLS = tc
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*cc.Timeout)
	defer cancel()
	st, err := cluster.Open(ctx, ccfg)
	if errors.Is(err, cluster.ErrConfig) {
		return fmt.Errorf("%w: Cluster: %w", ErrInvalidConfig, err)
	}
	if err != nil {
		return fmt.Errorf("offload: cluster tier: %w", err)
	}
	e.cluster = st
	return nil
}

// closeCluster closes the cluster tier (after the last write-through: no
// copy is in flight any more); it returns once the client's goroutines
// have ended.
func (e *Engine) closeCluster() error {
	if e.cluster == nil {
		return nil
	}
	return e.cluster.Close()
}

// writeThroughKeys returns the keys of a Store's slots (idx into keys) to
// write through when they are ready, nil when none are, and whether they
// go to the cluster: they do with a cluster tier and the engine's
// namespace (the cluster holds the engine's namespace only, which Prefetch
// promotes into); they go to disk with DiskConfig.WriteThrough.
func (e *Engine) writeThroughKeys(ns string, keys []Key, idx []int) ([]Key, bool) {
	toCluster := e.cluster != nil && ns == e.cfg.Namespace
	if !toCluster && (e.disk == nil || !e.disk.WritesThrough()) {
		return nil, false
	}
	out := make([]Key, len(idx))
	for j, i := range idx {
		out[j] = keys[i]
	}
	return out, toCluster
}

// writeThrough puts the ready slots' blocks (keys from writeThroughKeys) to
// the cluster (toCluster) and the disk (DiskConfig.WriteThrough), in the
// background, never waiting for either. Each slot is first leased (neither
// evicted nor reused): one whose handle went stale meanwhile (evicted by
// the completion's own eviction pass, deleted) is not written anywhere.
// The disk tier copies the bytes before through returns. The cluster tier
// copies them on its own goroutine (PutAsyncFrom), the slot leased and
// held against Trim until then, so that a store's completion does not
// spend a copy and a CRC of every block (a few hundred µs a 2 MiB block)
// on its own thread. Drops are counted by each tier.
func (e *Engine) writeThrough(keys []Key, slots []kvcache.Slot, toCluster bool) {
	if len(keys) != len(slots) || e.kc == nil {
		return
	}
	toDisk := e.disk != nil && e.disk.WritesThrough()
	if !toCluster && !toDisk {
		return
	}
	// One lock for the leases, one for the leases given back at once (a
	// drop, a cluster not connected), each copy's own when it is made.
	leased := e.kc.LeaseHandles(slots, nil)
	var done []kvcache.Slot // leases given back here, in one call
	for i, s := range slots {
		if !leased[i] {
			continue
		}
		mem := e.slotBytes(s)
		if mem == nil {
			done = append(done, s)
			continue
		}
		if toDisk {
			e.disk.Through(keys[i], mem)
		}
		one := slots[i : i+1 : i+1]
		if toCluster {
			e.hold(one)
			if e.putFrom(keys[i], mem, func() { e.releaseWriteThrough(one) }) {
				continue // given back by the cluster tier once copied
			}
			e.unhold(one)
		}
		done = append(done, s)
	}
	if len(done) > 0 {
		e.unlease(done)
	}
}

// putFrom is the cluster tier's PutAsyncFrom, or, under the test hook
// beforeClusterCopy, that call made later from a goroutine of its own
// (accepted meanwhile; a drop then releases at once).
func (e *Engine) putFrom(k Key, mem []byte, release func()) bool {
	hook := e.hooks.beforeClusterCopy
	if hook == nil {
		return e.cluster.PutAsyncFrom(k, mem, release)
	}
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		hook(k)
		if !e.cluster.PutAsyncFrom(k, mem, release) {
			release()
		}
	}()
	return true
}

// releaseWriteThrough gives back a slot writeThrough leased and held for
// the cluster tier's copy (after Close the lease is gone with the cache):
// the lease first, then the hold, then the reaper, so that a Trim woken by
// the hold finds the slot free (as every unlease does).
func (e *Engine) releaseWriteThrough(one []kvcache.Slot) {
	_ = e.kc.Unlease(one)
	e.unhold(one)
	e.kickReaper()
}

// clearCluster (Clear) empties the cluster's records of the engine's
// namespace, for every engine sharing it (the store bumps the namespace's
// generation), bounded by ClusterConfig.Timeout; a failure (the cluster
// down, or not connected yet) is not an error (the records expire with
// their TTL). Other namespaces have no records there.
func (e *Engine) clearCluster(ns string) {
	if e.cluster == nil || ns != e.cfg.Namespace {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), e.cfg.Cluster.Timeout)
	defer cancel()
	_ = e.cluster.Clear(ctx)
}

// FlushCluster waits until every write-through is answered, its events sent.
func (e *Engine) FlushCluster() error {
	if err := e.checkOpen("FlushCluster"); err != nil {
		return err
	}
	if e.cluster != nil {
		e.cluster.Flush()
	}
	return nil
}

// clusterTLS is the TLS configuration of ClusterConfig cc (TLS on).
func clusterTLS(cc *ClusterConfig) (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: cc.TLSServerName}
	if cc.TLSCAFile == "" {
		return tc, nil
	}
	pem, err := os.ReadFile(cc.TLSCAFile)
	if err != nil {
		return nil, fmt.Errorf("%w: Cluster.TLSCAFile: %w", ErrInvalidConfig, err)
	}
	tc.RootCAs = x509.NewCertPool()
	if !tc.RootCAs.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%w: Cluster.TLSCAFile %s holds no PEM certificate", ErrInvalidConfig, cc.TLSCAFile)
	}
	return tc, nil
}
