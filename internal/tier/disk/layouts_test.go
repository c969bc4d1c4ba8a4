package disk

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// Two layouts (two slot sizes) and a third, for the layout tests.
const (
	payloadA = 8192     // slots of 12 KiB
	payloadB = 3 * 4096 // slots of 16 KiB
	payloadC = 5 * 4096 // slots of 24 KiB
)

// putKeys stores keys lo..hi-1 in a store of cfg and closes it.
func putKeys(t *testing.T, cfg Config, lo, hi int) {
	t.Helper()
	s := open(t, cfg)
	for i := lo; i < hi; i++ {
		require.NoError(t, s.Put(key(i), payload(key(i), cfg.RecordPayloadBytes)))
	}
	require.NoError(t, s.Close())
}

// requireKeys opens a store of cfg and reads keys lo..hi-1 byte-exact.
func requireKeys(t *testing.T, cfg Config, lo, hi int) {
	t.Helper()
	s := open(t, cfg)
	require.Equal(t, int64(hi-lo), s.Stats().Records)
	for i := lo; i < hi; i++ {
		mustGet(t, s, key(i))
	}
	require.NoError(t, s.Close())
}

// TestOtherLayoutKept: a directory holding one layout's records, opened
// by a store of another layout (another slot size), keeps the first
// layout's records file: each store uses its own file beside the other,
// and both find their records byte-exact across reopens in any order.
func TestOtherLayoutKept(t *testing.T) {
	dir := t.TempDir()
	a, b := config(dir, payloadA, 16), config(dir, payloadB, 16)
	putKeys(t, a, 0, 10)
	fileA := filepath.Join(dir, recordsName(SlotBytes(payloadA)))
	before, err := os.ReadFile(fileA)
	require.NoError(t, err)
	putKeys(t, b, 100, 105)
	after, err := os.ReadFile(fileA)
	require.NoError(t, err)
	require.Equal(t, before, after, "layout A's records file is untouched by a store of layout B")
	requireKeys(t, a, 0, 10)
	requireKeys(t, b, 100, 105)
	requireKeys(t, a, 0, 10)
	files, err := filepath.Glob(filepath.Join(dir, "records-*.kvo"))
	require.NoError(t, err)
	require.ElementsMatch(t, []string{fileA, filepath.Join(dir, recordsName(SlotBytes(payloadB)))}, files)
	info := Inspect(dir)
	require.Len(t, info.Files, 2, "kvoffload info --disk lists both layouts' files")
}

// TestRemoveRecords: the explicit option removes only the records file it
// names (layout B's), never the store's own (A's, records intact) nor a
// third layout's; naming the store's own file or a name that is not a
// records file's is ErrConfig, and nothing is removed.
func TestRemoveRecords(t *testing.T) {
	dir := t.TempDir()
	a, b, c := config(dir, payloadA, 16), config(dir, payloadB, 16), config(dir, payloadC, 16)
	putKeys(t, a, 0, 10)
	putKeys(t, b, 100, 105)
	putKeys(t, c, 200, 203)
	nameA, nameB, nameC := recordsName(SlotBytes(payloadA)), recordsName(SlotBytes(payloadB)), recordsName(SlotBytes(payloadC))

	for _, bad := range [][]string{{nameA}, {"../" + nameB}, {"records-1.kvo"}, {"precious.txt"}, {nameB + ".bak"}} {
		cfg := a
		cfg.RemoveRecords = bad
		_, err := Open(cfg)
		require.ErrorIs(t, err, ErrConfig, "%q", bad)
		require.ErrorContains(t, err, bad[0])
	}
	for _, n := range []string{nameA, nameB, nameC} {
		_, err := os.Stat(filepath.Join(dir, n))
		require.NoError(t, err, "a refused configuration removed nothing: %s", n)
	}

	cfg := a
	cfg.RemoveRecords = []string{nameB}
	requireKeys(t, cfg, 0, 10)
	_, err := os.Stat(filepath.Join(dir, nameB))
	require.ErrorIs(t, err, os.ErrNotExist, "the named layout's file is removed")
	requireKeys(t, c, 200, 203)
	requireKeys(t, a, 0, 10)
	requireKeys(t, cfg, 0, 10) // a name no longer there is no error
}

// TestOtherLayoutNoSpace: ENOSPC at fallocate (injected: no root needed)
// with another layout's records in the directory fails naming that file
// and the option that removes it; the other layout's file is kept.
func TestOtherLayoutNoSpace(t *testing.T) {
	dir := t.TempDir()
	b := config(dir, payloadB, 16)
	putKeys(t, b, 100, 105)
	a := config(dir, payloadA, 16)
	a.faults = errOn(opFallocate, unix.ENOSPC, func() bool { return true })
	_, err := Open(a)
	require.ErrorIs(t, err, ErrNoUsableDir)
	require.ErrorIs(t, err, unix.ENOSPC)
	require.ErrorContains(t, err, "fallocate")
	require.ErrorContains(t, err, recordsName(SlotBytes(payloadB)))
	require.ErrorContains(t, err, "RemoveRecords")
	requireKeys(t, b, 100, 105)
}

// TestOtherLayoutNoSpaceTmpfs is TestOtherLayoutNoSpace on a real file
// system too small for both layouts (a 1 MiB tmpfs, mounted as root):
// the second layout's fallocate fails with ENOSPC naming the first
// layout's file, which keeps its records; with RemoveRecords naming it
// the second layout opens in its space.
func TestOtherLayoutNoSpaceTmpfs(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs needs root (TestOtherLayoutNoSpace injects the ENOSPC instead)")
	}
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=1m,mode=0700"); err != nil {
		if errors.Is(err, unix.EPERM) {
			t.Skipf("root without CAP_SYS_ADMIN cannot mount a tmpfs: %v", err)
		}
		require.NoError(t, err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, 0) })
	b := config(dir, payloadB, 40) // 40 slots of 16 KiB: 640 KiB of the 1 MiB
	putKeys(t, b, 100, 110)
	a := config(dir, payloadA, 40) // 40 slots of 12 KiB: 480 KiB more do not fit
	_, err := Open(a)
	require.ErrorIs(t, err, unix.ENOSPC)
	require.ErrorContains(t, err, recordsName(SlotBytes(payloadB)))
	requireKeys(t, b, 100, 110)
	a.RemoveRecords = []string{recordsName(SlotBytes(payloadB))}
	putKeys(t, a, 0, 10)
	requireKeys(t, a, 0, 10)
}
