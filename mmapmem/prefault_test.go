package mmapmem_test

import (
	"fmt"
	"os"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/mmapmem"
)

// TestDeferredPrefault maps regions with DeferPrefault, prefaults them
// chunk by chunk in a scrambled order and checks after each chunk that its
// pages, and (without huge pages) only its pages so far, are resident.
func TestDeferredPrefault(t *testing.T) {
	checkNoLeak(t)
	page := int64(os.Getpagesize())
	opts := map[string]mmapmem.Options{
		"thp":          {DeferPrefault: true},
		"no-thp":       {DeferPrefault: true, NoTHP: true, PrefaultThreads: 3},
		"no-thp-touch": {DeferPrefault: true, NoTHP: true, Prefault: mmapmem.PrefaultTouch, PrefaultStripe: 8192},
		"memfd":        {DeferPrefault: true, Memfd: true, NoTHP: true},
		"hugetlb":      {DeferPrefault: true, HugeTLB: true},
	}
	for name, o := range opts {
		for _, size := range []int64{1, 3*mib + 5, 5 * mib} {
			for _, chunk := range []int64{3 * page, 256 << 10, 2 * mib, 8 * mib} {
				t.Run(fmt.Sprintf("%s/%d/%d", name, size, chunk), func(t *testing.T) {
					r, err := mmapmem.New(size, o)
					require.NoError(t, err)
					defer func() { require.NoError(t, r.Close()) }()
					require.True(t, r.Deferred())
					exact := r.PageSize() == page && !r.THP()
					chunk := max(chunk/r.PageSize(), 1) * r.PageSize()
					res, err := mmapmem.ResidentMap(r)
					require.NoError(t, err)
					if exact {
						require.NotContains(t, res, true, "nothing touched by New")
					}
					var offs []int64
					for off := int64(0); off < r.Mapped(); off += chunk {
						offs = append(offs, off)
					}
					// Odd-indexed chunks first, then even, so that a chunk is
					// often prefaulted before the one below it.
					order := append(everyOther(offs, 1), everyOther(offs, 0)...)
					done := map[int64]bool{}
					for _, off := range order {
						n := min(chunk, r.Mapped()-off)
						require.NoError(t, r.Prefault(off, n))
						for p := off; p < off+n; p += page {
							done[p/page] = true
						}
						res, err := mmapmem.ResidentMap(r)
						require.NoError(t, err)
						for i, in := range res {
							if done[int64(i)] && !in {
								require.Failf(t, "not resident", "page %d after its chunk at %d", i, off)
							}
							if exact && !done[int64(i)] && in {
								require.Failf(t, "resident too early", "page %d outside the chunks prefaulted so far", i)
							}
						}
					}
					pages, total, err := mmapmem.Resident(r)
					require.NoError(t, err)
					require.Equal(t, total, pages)
				})
			}
		}
	}
}

func everyOther(xs []int64, from int) []int64 {
	var out []int64
	for i := from; i < len(xs); i += 2 {
		out = append(out, xs[i])
	}
	return out
}

// TestPrefaultKeepsContents writes a pattern, prefaults again with each
// method and checks that no byte changed.
func TestPrefaultKeepsContents(t *testing.T) {
	checkNoLeak(t)
	for _, m := range []mmapmem.PrefaultMethod{mmapmem.PrefaultTouch, mmapmem.PrefaultPopulate} {
		t.Run(m.String(), func(t *testing.T) {
			r, err := mmapmem.New(3*mib+1, mmapmem.Options{DeferPrefault: true, Prefault: m, PrefaultThreads: 2})
			require.NoError(t, err)
			defer func() { require.NoError(t, r.Close()) }()
			b := r.Bytes()
			for i := range b {
				b[i] = byte(i*7 + 1)
			}
			require.NoError(t, r.Prefault(0, r.Mapped()))
			require.NoError(t, r.Prefault(mib, 4096))
			for i := range b {
				if b[i] != byte(i*7+1) {
					require.Failf(t, "contents changed", "byte %d is %d, want %d", i, b[i], byte(i*7+1))
				}
			}
		})
	}
}

func TestPrefaultErrors(t *testing.T) {
	checkNoLeak(t)
	page := int64(os.Getpagesize())
	_, err := mmapmem.New(mib, mmapmem.Options{NoPrefault: true, DeferPrefault: true})
	require.ErrorIs(t, err, mmapmem.ErrOptions)
	require.ErrorContains(t, err, "NoPrefault and DeferPrefault")

	r, err := mmapmem.New(4*page+1, mmapmem.Options{DeferPrefault: true, NoTHP: true})
	require.NoError(t, err)
	cases := []struct{ off, n int64 }{
		{-page, page}, {0, 0}, {0, -1}, {1, page}, {page / 2, 1}, {0, 5*page + 1}, {5 * page, 1}, {6 * page, page}, {4 * page, page + 1},
	}
	for _, c := range cases {
		err := r.Prefault(c.off, c.n)
		require.ErrorIs(t, err, mmapmem.ErrRange, "off %d n %d", c.off, c.n)
		require.ErrorContains(t, err, fmt.Sprintf("prefault of %d bytes at offset %d", c.n, c.off))
		require.ErrorContains(t, err, fmt.Sprintf("%d bytes mapped", r.Mapped()))
	}
	require.NoError(t, r.Prefault(4*page, page), "the last page, beyond Len but inside the mapping")
	require.NoError(t, r.Prefault(page, 1), "n rounds up to the page")
	require.NoError(t, r.Close())
	require.ErrorIs(t, r.Prefault(0, page), mmapmem.ErrClosed)
}

// TestPrefaultWholeEndsDeferral: one Prefault call covering the whole
// mapping (n rounded up to the page) ends a deferred prefault; pieces do
// not, even when together they cover it; a region prefaulted by New was
// never deferred.
func TestPrefaultWholeEndsDeferral(t *testing.T) {
	checkNoLeak(t)
	page := int64(os.Getpagesize())
	cases := []struct {
		name     string
		opts     mmapmem.Options
		calls    func(r *mmapmem.Region) [][2]int64 // {off, n}
		deferred bool
	}{
		{"none", mmapmem.Options{DeferPrefault: true}, func(*mmapmem.Region) [][2]int64 { return nil }, true},
		{"whole", mmapmem.Options{DeferPrefault: true, NoTHP: true}, func(r *mmapmem.Region) [][2]int64 { return [][2]int64{{0, r.Mapped()}} }, false},
		{"len rounds to mapped", mmapmem.Options{DeferPrefault: true, NoTHP: true}, func(r *mmapmem.Region) [][2]int64 { return [][2]int64{{0, r.Len()}} }, false},
		{"pieces", mmapmem.Options{DeferPrefault: true, NoTHP: true}, func(r *mmapmem.Region) [][2]int64 {
			return [][2]int64{{0, page}, {page, r.Mapped() - page}}
		}, true},
		{"tail only", mmapmem.Options{DeferPrefault: true, NoTHP: true}, func(r *mmapmem.Region) [][2]int64 { return [][2]int64{{page, r.Mapped() - page}} }, true},
		{"prefaulted by New", mmapmem.Options{NoTHP: true}, func(r *mmapmem.Region) [][2]int64 { return nil }, false},
		{"not prefaulted", mmapmem.Options{NoPrefault: true}, func(r *mmapmem.Region) [][2]int64 { return nil }, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r, err := mmapmem.New(3*page+5, c.opts)
			require.NoError(t, err)
			defer func() { require.NoError(t, r.Close()) }()
			for _, call := range c.calls(r) {
				require.NoError(t, r.Prefault(call[0], call[1]))
			}
			require.Equal(t, c.deferred, r.Deferred())
		})
	}
}

// TestPrefaultStop: a prefault whose PrefaultStop is closed ends before
// its next piece with ErrPrefaultStopped, both in Region.Prefault and in
// New, which then leaves nothing mapped.
func TestPrefaultStop(t *testing.T) {
	checkNoLeak(t)
	stop := make(chan struct{})
	close(stop)
	r, err := mmapmem.New(64*mib, mmapmem.Options{DeferPrefault: true, NoTHP: true, PrefaultThreads: 2, PrefaultStop: stop})
	require.NoError(t, err, "a deferred prefault does not start in New")
	defer func() { require.NoError(t, r.Close()) }()
	err = r.Prefault(0, r.Mapped())
	require.ErrorIs(t, err, mmapmem.ErrPrefaultStopped)
	require.True(t, r.Deferred(), "a stopped prefault does not end the deferral")
	pages, _, err := mmapmem.Resident(r)
	require.NoError(t, err)
	require.Zero(t, pages, "stopped before its first piece")

	_, err = mmapmem.New(64*mib, mmapmem.Options{NoTHP: true, PrefaultStop: stop})
	require.ErrorIs(t, err, mmapmem.ErrPrefaultStopped)

	open := make(chan struct{})
	r2, err := mmapmem.New(64*mib, mmapmem.Options{NoTHP: true, PrefaultStop: open})
	require.NoError(t, err, "an open stop channel stops nothing")
	require.NoError(t, r2.Close())
}

// TestPrefaultStopMidway closes PrefaultStop from another goroutine while
// one thread prefaults a region piece by piece (the touch method on base
// pages, slow enough to be caught half-way): the prefault ends early, with
// part of the region resident.
func TestPrefaultStopMidway(t *testing.T) {
	checkNoLeak(t)
	mmapmem.ForceTouchPrefault(t)
	stop := make(chan struct{})
	r, err := mmapmem.New(512*mib, mmapmem.Options{DeferPrefault: true, NoTHP: true, PrefaultThreads: 1, PrefaultStop: stop})
	require.NoError(t, err)
	defer func() { require.NoError(t, r.Close()) }()
	go func() {
		for {
			if pages, _, err := mmapmem.Resident(r); err != nil || pages > 0 {
				close(stop)
				return
			}
		}
	}()
	err = r.Prefault(0, r.Mapped())
	if err == nil {
		t.Skip("the prefault of 512 MiB finished before the stop was seen")
	}
	require.ErrorIs(t, err, mmapmem.ErrPrefaultStopped)
	pages, total, err := mmapmem.Resident(r)
	require.NoError(t, err)
	require.Positive(t, pages)
	require.Less(t, pages, total, "stopped before the end")
}

// TestPrefaultPriority: prefault threads run at the nice value raised by
// PrefaultNice, and the caller's thread keeps its own.
func TestPrefaultPriority(t *testing.T) {
	checkNoLeak(t)
	done := make(chan int)
	go func() {
		runtime.LockOSThread() // not unlocked: the thread ends with this goroutine
		before, err := unix.Getpriority(unix.PRIO_PROCESS, 0)
		require.NoError(t, err)
		mmapmem.LowerPriority(3)
		after, err := unix.Getpriority(unix.PRIO_PROCESS, 0)
		require.NoError(t, err)
		done <- before - after // the raw call returns 20 - nice
	}()
	require.Equal(t, 3, <-done)

	for _, nice := range []int{0, 5, -1} {
		res := make(chan [2]int)
		go func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			before, _ := unix.Getpriority(unix.PRIO_PROCESS, 0)
			r, err := mmapmem.New(16*mib, mmapmem.Options{NoTHP: true, PrefaultThreads: 2, PrefaultNice: nice})
			require.NoError(t, err)
			require.NoError(t, r.Close())
			after, _ := unix.Getpriority(unix.PRIO_PROCESS, 0)
			res <- [2]int{before, after}
		}()
		p := <-res
		require.Equal(t, p[0], p[1], "PrefaultNice %d: the caller's thread keeps its priority", nice)
	}
	_, err := mmapmem.New(mib, mmapmem.Options{PrefaultNice: 20})
	require.ErrorIs(t, err, mmapmem.ErrOptions)
	require.ErrorContains(t, err, "PrefaultNice 20: must be at most 19")
}
