package register

import (
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/mmapmem"
)

// SetHostFuncs replaces the system calls a Host pinner makes; nil keeps one.
func SetHostFuncs(h *Host, mlock, munlock func([]byte) error, getrlimit func(int, *unix.Rlimit) error) {
	if mlock != nil {
		h.mlock = mlock
	}
	if munlock != nil {
		h.munlock = munlock
	}
	if getrlimit != nil {
		h.getrlimit = getrlimit
	}
}

// SetPrefault replaces the prefault of deferred regions' ranges for the
// rest of the test (f gets the region, offset and length).
func SetPrefault(t *testing.T, f func(r *mmapmem.Region, off, n int64) error) {
	prev := prefaultRange
	prefaultRange = f
	t.Cleanup(func() { prefaultRange = prev })
}
