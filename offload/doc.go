// Package offload is the engine a serving stack embeds to move KV-cache
// blocks between GPU memory and a pool of pinned host memory: the only
// package of kvoffload a Go user imports.
//
// The engine is being assembled; the API below is the contract (see the
// package's README section for the serving-loop pattern).
package offload
