package register

import (
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/mmapmem"
)

// Host pins regions with mlock(2): their pages stay resident, which is what
// a host-side copy engine (or an RDMA NIC registering them later) needs.
type Host struct {
	*tracker
	mlock     func([]byte) error
	munlock   func([]byte) error
	getrlimit func(resource int, rlim *unix.Rlimit) error
}

var _ Pinner = (*Host)(nil)

// NewHost returns an mlock pinner.
func NewHost() *Host {
	h := &Host{mlock: unix.Mlock, munlock: unix.Munlock, getrlimit: unix.Getrlimit}
	h.tracker = newTracker("host-mlock", func(*mmapmem.Region) int64 { return 0 }, h.pin, h.unpin)
	return h
}

// mapping is the bytes of range rg of r's mapping.
func mapping(r *mmapmem.Region, rg Range) []byte {
	return unsafe.Slice((*byte)(unsafe.Add(r.Pointer(), rg.Off)), rg.Len)
}

func (h *Host) pin(r *mmapmem.Region, ranges []Range) ([]Range, error) {
	for k, rg := range ranges {
		err := h.mlock(mapping(r, rg))
		if err == nil {
			continue
		}
		// A failed mlock may have locked part of the range; unlock it all.
		_, uerr := h.unpin(r, ranges[:k+1])
		err = h.explain(rg.Len, err)
		if uerr != nil {
			return ranges[:k+1], errors.Join(err, uerr)
		}
		return nil, err
	}
	return ranges, nil
}

func (h *Host) unpin(r *mmapmem.Region, ranges []Range) ([]Range, error) {
	var left []Range
	var errs []error
	for _, rg := range ranges {
		if err := h.munlock(mapping(r, rg)); err != nil {
			left = append(left, rg)
			errs = append(errs, fmt.Errorf("register: host: munlock %d bytes at offset %d of %s: %w", rg.Len, rg.Off, r, err))
		}
	}
	return left, errors.Join(errs...)
}

// explain turns mlock's ENOMEM/EPERM into an error naming RLIMIT_MEMLOCK
// and the amount asked for.
func (h *Host) explain(asked int64, err error) error {
	if !errors.Is(err, unix.ENOMEM) && !errors.Is(err, unix.EPERM) {
		return fmt.Errorf("register: host: mlock %d bytes: %w", asked, err)
	}
	var lim unix.Rlimit
	if lerr := h.getrlimit(unix.RLIMIT_MEMLOCK, &lim); lerr != nil {
		return fmt.Errorf("%w: mlock %d bytes refused (RLIMIT_MEMLOCK unreadable: %v): %w", ErrMemlockLimit, asked, lerr, err)
	}
	locked := h.Stats().RegisteredBytes
	return fmt.Errorf("%w: mlock %d bytes refused: RLIMIT_MEMLOCK is %s (hard %s), %d bytes already locked by this pinner; "+
		"raise it (ulimit -l, systemd LimitMEMLOCK=, docker --ulimit memlock=-1) or use no pinning: %w",
		ErrMemlockLimit, asked, rlimitString(lim.Cur), rlimitString(lim.Max), locked, err)
}

func rlimitString(v uint64) string {
	if v == unix.RLIM_INFINITY {
		return "unlimited"
	}
	return fmt.Sprintf("%d bytes", v)
}

// None pins nothing: Register only records the region (and holds it, so it
// still cannot be closed while registered). For development machines.
type None struct{ *tracker }

var _ Pinner = (*None)(nil)

// NewNone returns a pinner that pins nothing.
func NewNone() *None {
	keep := func(_ *mmapmem.Region, ranges []Range) ([]Range, error) { return ranges, nil }
	drop := func(*mmapmem.Region, []Range) ([]Range, error) { return nil, nil }
	return &None{newTracker("none", func(*mmapmem.Region) int64 { return 0 }, keep, drop)}
}
