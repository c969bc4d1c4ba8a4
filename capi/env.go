package main

/*
#include <stdlib.h>
*/
import "C"

import (
	"unsafe"

	"github.com/kvoffload/kvoffload/internal/envvar"
)

// Go keeps its own copy of the environment, taken when the library loads:
// the environment the process started with. A host that sets a KVOFFLOAD_*
// switch later (Python's os.environ, C's setenv) would not reach an
// engine, whose switches then silently kept their exec-time values. So
// the engine reads them through C's getenv, the process's current
// environment; nothing is written to it.
func init() { envvar.SetLookup(getenvC) }

// getenvC is envvar's Lookup through C's getenv.
func getenvC(name string) (string, bool) {
	cn := C.CString(name)
	defer C.free(unsafe.Pointer(cn))
	v := C.getenv(cn)
	if v == nil {
		return "", false
	}
	return C.GoString(v), true
}

// setenvC and unsetenvC change the process's environment the way a host
// does, behind Go's copy (tests).
func setenvC(k, v string) {
	ck, cv := C.CString(k), C.CString(v)
	defer C.free(unsafe.Pointer(ck))
	defer C.free(unsafe.Pointer(cv))
	C.setenv(ck, cv, 1)
}

func unsetenvC(k string) {
	ck := C.CString(k)
	defer C.free(unsafe.Pointer(ck))
	C.unsetenv(ck)
}
