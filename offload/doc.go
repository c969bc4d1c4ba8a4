// Package offload is the engine a serving stack embeds to move KV-cache
// blocks between its GPU KV cache and a pool of pinned host memory, so
// that evicted prefixes come back at PCIe speed instead of being
// recomputed. New builds it from a Config (Backend "auto": CUDA when the
// driver and device addresses are there, else the host backend, a
// simulated GPU; see offload/hostsim); Dial builds it over a node pool
// shared by a machine's processes.
//
// The serving loop: Keys hashes a sequence's tokens into chained keys;
// Lookup returns the longest prefix ready in the pool (optionally
// leased); Store and Load return an Op at once and never block on the
// GPU. Every block of an Op gets exactly one Outcome; a block is visible
// only once copied, a slot reused only once its copies are done, and a
// copy failure fails only its op. On CUDA the stack's stream waits on
// Op.Event (or StreamWait) before reusing a stored block or reading a
// loaded one. After a sticky driver error Store and Load fail with
// ErrDeviceLost.
//
// New pins a first region and returns; the rest grows in the background.
// Memory goes back only through Trim, MaxCachedBytes or Close. The pool
// is private, pinned memory kept out of core dumps; errors never contain
// block contents. KVOFFLOAD_TRACE_CALLS=N traces the first N Store and
// Load calls to stderr.
package offload
