package register

import "golang.org/x/sys/unix"

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
