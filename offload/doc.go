// Package offload is the engine a serving stack embeds to move KV-cache
// blocks between its GPU KV cache and a pool of pinned host memory. New
// builds it from a Config (Backend "auto": CUDA, else a simulated GPU, see
// offload/hostsim); Dial builds it over a node pool shared by a machine.
//
// Lookup returns the longest prefix of keys (Keys) ready in the pool;
// Store and Load return an Op at once and never block on the GPU. Every
// block of an Op gets exactly one Outcome; a block is visible only once
// copied, a slot reused only once its copies are done, a copy failure
// fails only its op. On CUDA the stack's stream waits on Op.Event (or
// StreamWait) before reusing a stored block or reading a loaded one.
//
// New pins a first region and returns; the rest grows in the background.
// Memory goes back only through Trim, MaxCachedBytes or Close. The pool
// is private pinned memory kept out of core dumps; errors never contain
// block contents. KVOFFLOAD_TRACE_CALLS=N traces the first N Store and
// Load calls to stderr.
package offload
