//go:build cgo

package main

import (
	"os"
	"runtime"
)

// maxProcs bounds the Go runtime's GOMAXPROCS in the library: the engine's
// work is copies on the GPU and bookkeeping, and a few threads running Go
// code are plenty; more only compete with the host process's own threads.
const maxProcs = 8

// The library caps GOMAXPROCS when it is loaded (package initialization
// runs before any export returns), unless the GOMAXPROCS environment
// variable is set: then the runtime has used it and it is kept.
func init() {
	if n := cappedMaxProcs(os.Getenv("GOMAXPROCS"), runtime.GOMAXPROCS(0)); n > 0 {
		runtime.GOMAXPROCS(n)
	}
}

// cappedMaxProcs is the GOMAXPROCS to set, given the environment
// variable's value env and the runtime's current setting (its default:
// the CPUs available to the process, by affinity and cgroup limit), or 0
// to leave it: a value set in the environment is the user's, and a
// default at or below maxProcs is kept (and keeps the runtime's automatic
// updates, which an explicit runtime.GOMAXPROCS call turns off).
func cappedMaxProcs(env string, current int) int {
	if env != "" || current <= maxProcs {
		return 0
	}
	return maxProcs
}
