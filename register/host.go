package register

import (
	"errors"
	"fmt"
	"os"
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

// HostOptions configure a Host pinner.
type HostOptions struct {
	// PipelineChunk is the mlock range for regions mapped with
	// mmapmem.Options.DeferPrefault, prefaulted range by range ahead of
	// mlock (see CUDAOptions.PipelineChunk); 0 means DefaultPipelineChunk.
	// It must be a positive multiple of the page size. Other regions are
	// locked in one range.
	PipelineChunk int64
}

// NewHost returns an mlock pinner with the default options.
func NewHost() *Host {
	h, _ := NewHostWithOptions(HostOptions{}) // the zero options are valid
	return h
}

// NewHostWithOptions returns an mlock pinner.
func NewHostWithOptions(opts HostOptions) (*Host, error) {
	chunk, err := pipelineChunk(opts.PipelineChunk, int64(os.Getpagesize()))
	if err != nil {
		return nil, err
	}
	h := &Host{mlock: unix.Mlock, munlock: unix.Munlock, getrlimit: unix.Getrlimit}
	h.tracker = newTracker("host-mlock", rangeLimit(0, chunk), h.pin, h.unpin)
	return h, nil
}

// mapping is the bytes of range rg of r's mapping.
func mapping(r *mmapmem.Region, rg Range) []byte {
	return unsafe.Slice((*byte)(unsafe.Add(r.Pointer(), rg.Off)), rg.Len)
}

// pin locks ranges in order, each prefaulted first when r's prefault was
// deferred (see eachPrefaulted), and on a failure at range k unlocks
// ranges 0..k again (a failed mlock may have locked part of range k).
func (h *Host) pin(r *mmapmem.Region, ranges []Range) ([]Range, error) {
	mlocked := false
	k, err := eachPrefaulted(r, ranges, func(_ int, rg Range) error {
		if err := h.mlock(mapping(r, rg)); err != nil {
			mlocked = true
			return h.explain(rg.Len, err)
		}
		return nil
	})
	if err == nil {
		return ranges, nil
	}
	touched := ranges[:k]
	if mlocked {
		touched = ranges[:k+1]
	}
	fail := &RangeError{Pinner: h.kind, Region: r.String(), Index: k, Count: len(ranges), Range: ranges[k], Err: err}
	if left, uerr := h.unpin(r, touched); uerr != nil {
		return left, errors.Join(fail, uerr)
	}
	return nil, fail
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
