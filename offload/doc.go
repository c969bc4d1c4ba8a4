// Package offload is the engine a serving stack embeds to move KV-cache
// blocks between GPU memory and a pool of pinned host memory: the only
// package of kvoffload a Go user imports.
//
// New maps and pins the staging region and the first pool region, then
// returns; the rest of the pool is pinned region by region by a background
// goroutine (PauseGrowth, ResumeGrowth, WaitGrown; Stats.FirstSlot and
// Stats.FullPool report the times). Memory goes back to the OS only through
// Trim, Config.MaxCachedBytes, or Close.
//
// Store and Load return an Op at once; see Op for what it guarantees. Every
// block of every op gets exactly one Outcome. Engine methods are safe for
// concurrent use.
//
// This build runs the host backend (a simulated GPU, SimGPU); the CUDA
// backend is selected by Backend "auto" only once it is wired in.
package offload
