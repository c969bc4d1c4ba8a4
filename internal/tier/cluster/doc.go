// Package cluster is the cluster tier: records (package record's format) kept
// in a Redis Cluster, written through asynchronously and read back by a
// deadline-bound batch Get (each record streamed on a connection of its own). It knows nothing of CUDA or of the
// engine, which writes host blocks through into it on store and promotes
// what Get finds into pinned slots (Prefetch).
//
// # Client
//
// github.com/redis/rueidis: maintained by the Redis organisation, cluster
// aware (slot map, MOVED and ASK followed and the map refreshed, retries of
// idempotent reads), auto-pipelining (concurrent commands to one node share
// one write and one round trip), streamed replies, RESP3, contexts for
// deadlines, AUTH with a password or an ACL user, TLS. A record is copied
// once, with its CRC, behind its header into a buffer of the store (the
// payload and the header must be one value); the client then copies only
// the head of the value: rueidis.BinaryString aliases the record buffer and
// the connection is an io.StringWriter, so once the client's write buffer
// (4 KiB here) is full and flushed the rest of the value goes from the
// record buffer to the socket. Get streams each record (one GET per connection of a node's
// stream pool, Config.Streams at once, shared out by master: see
// slots.go): the reply's bytes go from the socket
// into a pooled buffer, the payload's CRC-32C is computed piece by piece as
// they arrive, and a verified record is copied once into the caller's
// buffer; no reply is allocated. GetDirect receives the payload straight
// into the caller's buffer instead (no copy at all; the engine's promotion
// into reserved pool slots uses it), at the price of leaving a failed
// destination's bytes undefined. Streams neither follow redirections nor
// retry, so a GET that fails any other way than an absent key is sent again
// pipelined, the client's ordinary path, which does. valkey-go is the same
// code under the Valkey project; go-redis allocates a command object and
// more per call and pipelines only when asked.
//
// # Keys and generations
//
// A record's key is <Prefix>:<Namespace>:<generation>:<block key, 32 hex
// digits>. Keys carry no hash tag, so records spread over every slot and
// master. The namespace's generation is the integer at <Prefix>:<Namespace>:gen
// (absent is 0). Clear INCRs it: records of older generations are unreachable
// at once (no reader builds their keys) and expire by TTL. Every Store reads
// the generation at Open and again every Config.GenerationRefresh, so other
// writers' Clears reach it within that period; a store never goes back to a
// lower generation than it has seen (should the generation key be evicted, the
// next Clear sets it above the highest one seen here).
//
// # Eviction
//
// The cluster evicts, not this package: run the masters with a maxmemory and
// maxmemory-policy allkeys-lru, so that the least recently used records make
// room (the generation key is read every GenerationRefresh, which keeps it
// recent). Under noeviction a full cluster refuses writes with an OOM error:
// each is a failed put, counted (Stats.PutErrors, Stats.PutOOM). Every record
// has the TTL Config.TTL.
//
// # What it guarantees
//
//   - Get never fills a destination with bytes that fail a check: the header
//     checksum, the format and host-layout versions, the fingerprint, the key,
//     the length and the payload's CRC-32C are verified on the reply before
//     one byte is copied into the destination. A destination whose Get
//     returned false is left untouched (GetDirect: holds undefined bytes,
//     still reported false).
//   - Every failure is a miss or a dropped put, counted, never an error on the
//     serving path: a key that is absent, a record that fails a check, a
//     master down, a timeout, a node refusing a write (OOM), a closed store.
//   - PutAsync never blocks on the network: it copies the payload behind a
//     header into a buffer of its own (the caller may reuse its payload as soon
//     as PutAsync returns) and returns; PutAsyncFrom makes that copy on the
//     put's goroutine instead and calls the caller's release once it is made
//     (exactly once per accepted put, never for a drop). The bytes of records not yet
//     acknowledged are bounded by Config.MaxInFlightBytes, past which PutAsync
//     returns false and counts a drop. Config.OnPutDone is called once per
//     accepted put when the cluster has answered.
//
// # Connecting and closing
//
// Open connects before it returns, or fails (a server that answers but is
// not in a cluster, cluster mode off or the cluster not created yet, is a
// failure too: the client would talk to it alone). With Config.Background a
// cluster that does not answer is no error: the store is not Available
// (puts dropped and Gets missed at once, counted apart as unavailable, the
// last attempt's error in Stats.ConnectError) and connects on a goroutine of
// its own, with a doubling backoff, until it succeeds or is closed. Close
// returns only when every goroutine of the store and of its client has
// ended (the client's background work after a node failure or a topology
// change included): no goroutine of a closed store outlives Close. The
// client sends no keep-alive PING (its timers' goroutines could not be
// waited for): a dead node is found by the deadline every command carries.
//
// # Concurrency
//
// Every method is safe for concurrent use.
package cluster
