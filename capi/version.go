//go:build cgo

package main

/*
#include <stdlib.h>
*/
import "C"

import "github.com/kvoffload/kvoffload/internal/version"

// versionC is the release version as a C string, allocated once and never
// freed: kvo_version() hands out this pointer.
var versionC = C.CString(version.Version)

// kvoGo_version returns the release version (internal/version/VERSION);
// kvo_version in kvoffload.c calls it once and keeps the pointer.
//
//export kvoGo_version
func kvoGo_version() *C.char { return versionC }
