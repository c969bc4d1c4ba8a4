package register_test

import (
	"errors"
	"fmt"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/mmapmem"
	"github.com/kvoffload/kvoffload/register"
)

func TestHostMlockErrors(t *testing.T) {
	limit := func(cur, hard uint64) func(int, *unix.Rlimit) error {
		return func(res int, l *unix.Rlimit) error {
			require.Equal(t, unix.RLIMIT_MEMLOCK, res)
			*l = unix.Rlimit{Cur: cur, Max: hard}
			return nil
		}
	}
	cases := []struct {
		name      string
		mlockErr  error
		getrlimit func(int, *unix.Rlimit) error
		isLimit   bool
		words     []string
	}{
		{"ENOMEM", unix.ENOMEM, limit(65536, 65536), true, []string{"RLIMIT_MEMLOCK is 65536 bytes (hard 65536 bytes)", "mlock 102400 bytes refused", "ulimit -l"}},
		{"EPERM", unix.EPERM, limit(0, unix.RLIM_INFINITY), true, []string{"RLIMIT_MEMLOCK is 0 bytes (hard unlimited)"}},
		{"limit unreadable", unix.ENOMEM, func(int, *unix.Rlimit) error { return unix.EFAULT }, true, []string{"RLIMIT_MEMLOCK unreadable"}},
		{"other error", unix.EINVAL, limit(0, 0), false, []string{"mlock 102400 bytes"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := register.NewHost()
			unlocked := 0
			register.SetHostFuncs(h,
				func([]byte) error { return c.mlockErr },
				func([]byte) error { unlocked++; return nil },
				c.getrlimit)
			r := newRegion(t, 100*kib)
			err := h.Register(r)
			require.ErrorIs(t, err, c.mlockErr)
			require.Equal(t, c.isLimit, errors.Is(err, register.ErrMemlockLimit))
			for _, w := range c.words {
				require.Contains(t, err.Error(), w)
			}
			require.Equal(t, 1, unlocked, "a failed mlock is undone")
			require.False(t, h.Registered(r))
			require.Empty(t, r.Holders())
			require.Equal(t, int64(1), h.Stats().RegisterFailures)
		})
	}
}

// TestHostMlockRealLimit lowers RLIMIT_MEMLOCK below the region's size and
// checks the kernel's refusal is reported. Root is not bound by the limit,
// so the test thread first drops CAP_IPC_LOCK from its effective set
// (capabilities are per thread; the thread is discarded afterwards).
func TestHostMlockRealLimit(t *testing.T) {
	var old unix.Rlimit
	require.NoError(t, unix.Getrlimit(unix.RLIMIT_MEMLOCK, &old))
	low := unix.Rlimit{Cur: min(64*kib, old.Max), Max: old.Max}
	r := newRegion(t, mib)
	h := register.NewHost()

	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread dies with the goroutine
		hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
		var data [2]unix.CapUserData
		if err := unix.Capget(&hdr, &data[0]); err != nil {
			errc <- fmt.Errorf("capget: %w", err)
			return
		}
		data[0].Effective &^= 1 << unix.CAP_IPC_LOCK
		if err := unix.Capset(&hdr, &data[0]); err != nil {
			errc <- fmt.Errorf("capset: %w", err)
			return
		}
		if err := unix.Setrlimit(unix.RLIMIT_MEMLOCK, &low); err != nil {
			errc <- fmt.Errorf("setrlimit: %w", err)
			return
		}
		err := h.Register(r)
		if rerr := unix.Setrlimit(unix.RLIMIT_MEMLOCK, &old); rerr != nil {
			err = fmt.Errorf("restore RLIMIT_MEMLOCK: %w (after %w)", rerr, err)
		}
		errc <- err
	}()
	err := <-errc
	require.ErrorIs(t, err, register.ErrMemlockLimit)
	require.Contains(t, err.Error(), fmt.Sprintf("RLIMIT_MEMLOCK is %d bytes", low.Cur))
	require.Contains(t, err.Error(), fmt.Sprintf("mlock %d bytes refused", r.Mapped()))
	require.False(t, h.Registered(r))
	require.NoError(t, r.Close())
}

func TestHostMlockWorks(t *testing.T) {
	r, err := mmapmem.New(64*kib, mmapmem.Options{NoPrefault: true})
	require.NoError(t, err)
	h := register.NewHost()
	require.NoError(t, h.Register(r))
	pages, total, err := mmapmem.Resident(r)
	require.NoError(t, err)
	require.Equal(t, total, pages, "mlock faults every page in")
	flags, err := mmapmem.VMAFlags(r.Addr())
	require.NoError(t, err)
	require.Contains(t, flags, "lo", "VM_LOCKED")
	require.NoError(t, register.Release(h, r))
}
