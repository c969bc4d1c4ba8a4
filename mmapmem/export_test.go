package mmapmem

import (
	"os"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// MappedBytes is the number of bytes this package holds mapped right now.
func MappedBytes() int64 { return mappedBytes.Load() }

// ForceTouchPrefault makes prefaulting take the touch-one-byte-per-page path
// for the rest of the test.
func ForceTouchPrefault(t *testing.T) {
	prev := populateUnsupported.Load()
	populateUnsupported.Store(true)
	t.Cleanup(func() { populateUnsupported.Store(prev) })
}

// ResidentMap reports, per base page of r's mapping, whether it is resident
// (mincore(2)).
func ResidentMap(r *Region) ([]bool, error) {
	page := int64(os.Getpagesize())
	vec := make([]byte, (r.mapped+page-1)/page)
	if _, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(r.ptr), uintptr(r.mapped), uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
		return nil, errno
	}
	out := make([]bool, len(vec))
	for i, v := range vec {
		out[i] = v&1 != 0
	}
	return out, nil
}

// LowerPriority is lowerPriority: it raises the calling thread's nice value
// by inc.
func LowerPriority(inc int) { lowerPriority(inc) }

// The errors and the region's NUMA node, for the external tests.
var (
	ErrSize               = errSize
	ErrOptions            = errOptions
	ErrNUMANode           = errNUMANode
	ErrInsufficientMemory = errInsufficientMemory
	ErrRange              = errRange
	ErrPrefaultStopped    = errPrefaultStopped
)

// NUMANode is r.numaNode: the node r is bound to, and whether it is bound.
func NUMANode(r *Region) (int, bool) { return r.numaNode() }

// PrefaultAuto is the zero PrefaultMethod: DefaultPrefaultMethod.
const PrefaultAuto = prefaultAuto
