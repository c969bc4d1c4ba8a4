//go:build cgo

package cuda

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdlib.h>
*/
import "C"

import (
	"errors"
	"runtime"
	"unsafe"
)

// library is a dlopen'd shared object. dlerror is thread-local, so every
// dl call runs with the goroutine locked to its OS thread.
type library struct {
	path   string
	handle unsafe.Pointer
}

func dlopen(path string) (*library, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	C.dlerror()
	h := C.dlopen(cpath, C.RTLD_NOW|C.RTLD_LOCAL)
	if h == nil {
		return nil, dlerr("dlopen " + path)
	}
	return &library{path: path, handle: h}, nil
}

// sym returns the address of name, or an error when it is not exported.
func (l *library) sym(name string) (unsafe.Pointer, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	C.dlerror()
	p := C.dlsym(l.handle, cname)
	if p == nil {
		return nil, dlerr("dlsym " + name)
	}
	return p, nil
}

func (l *library) close() error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	C.dlerror()
	if C.dlclose(l.handle) != 0 {
		return dlerr("dlclose " + l.path)
	}
	return nil
}

// dlerr returns dlerror's message for what; the caller holds its thread.
func dlerr(what string) error {
	if msg := C.dlerror(); msg != nil {
		return errors.New(what + ": " + C.GoString(msg))
	}
	return errors.New(what + ": unknown dl error")
}
