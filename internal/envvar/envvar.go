// Package envvar is where the engine reads its environment switches (the
// KVOFFLOAD_* comparisons and diagnostics of package offload): through
// Lookup, os.LookupEnv unless a host replaced it (SetLookup).
//
// Why it can be replaced: Go keeps its own copy of the environment, taken
// when the runtime starts. In a shared library (package capi) that is the
// environment the process started with, so a switch a host sets later
// (Python's os.environ, C's setenv) would never reach an engine. The C ABI
// sets a Lookup that reads the process's current environment with C's
// getenv, which writes nothing.
//
// Invariant: Lookup is safe for concurrent use, and SetLookup may be
// called at any time (an engine made after it reads through the new
// function).
package envvar

import (
	"os"
	"sync/atomic"
)

var lookup atomic.Pointer[func(string) (string, bool)]

// Lookup returns the value of the environment variable name and whether it
// is set.
func Lookup(name string) (string, bool) {
	if f := lookup.Load(); f != nil {
		return (*f)(name)
	}
	return os.LookupEnv(name)
}

// Get is Lookup's value, "" when unset.
func Get(name string) string {
	v, _ := Lookup(name)
	return v
}

// SetLookup makes f the way Lookup reads the environment (nil: back to
// os.LookupEnv).
func SetLookup(f func(string) (string, bool)) {
	if f == nil {
		lookup.Store(nil)
		return
	}
	lookup.Store(&f)
}
