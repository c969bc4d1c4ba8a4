// Package offload moves KV-cache blocks between a serving stack's GPU KV
// cache and a pool of pinned host memory. Store and Load return an Op at
// once, never blocking on the GPU; every block of an Op gets exactly one
// Outcome. A block is visible only once copied, a slot reused only once its
// copies are done; on CUDA the stack's stream waits on the Op
// (Op.StreamWait) before reusing a stored block or reading a loaded one.
// The pool is private memory kept out of core dumps; errors never contain
// block contents.
package offload
