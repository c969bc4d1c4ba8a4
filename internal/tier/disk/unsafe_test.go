package disk

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// victim is a file outside the store's directory that a planted link
// points at: its bytes, size and times must come out of every Open as
// they went in.
type victim struct {
	path   string
	data   []byte
	st     os.FileInfo
	blocks int64 // allocated 512-byte blocks
}

func newVictim(t *testing.T) *victim {
	t.Helper()
	v := &victim{path: filepath.Join(t.TempDir(), "precious.txt"), data: []byte("another program's data, 33 bytes\n")}
	require.NoError(t, os.WriteFile(v.path, v.data, 0o600))
	st, err := os.Stat(v.path)
	require.NoError(t, err)
	v.st = st
	var sys unix.Stat_t
	require.NoError(t, unix.Stat(v.path, &sys))
	v.blocks = sys.Blocks
	return v
}

func (v *victim) requireUnchanged(t *testing.T) {
	t.Helper()
	b, err := os.ReadFile(v.path)
	require.NoError(t, err)
	require.Equal(t, v.data, b, "the file outside the directory is unchanged")
	st, err := os.Stat(v.path)
	require.NoError(t, err)
	require.Equal(t, v.st.Size(), st.Size())
	require.Equal(t, v.st.ModTime(), st.ModTime())
	var sys unix.Stat_t
	require.NoError(t, unix.Stat(v.path, &sys))
	require.Equal(t, v.blocks, sys.Blocks, "nothing preallocated in it")
}

// requireUnsafe checks that Open of cfg failed with ErrUnsafeFile naming
// path and why.
func requireUnsafe(t *testing.T, cfg Config, path, why string) {
	t.Helper()
	s, err := Open(cfg)
	if err == nil {
		s.Close()
	}
	require.Error(t, err)
	require.ErrorIs(t, err, ErrUnsafeFile)
	require.ErrorIs(t, err, ErrNoUsableDir, "the one directory is not used")
	require.ErrorContains(t, err, path)
	require.ErrorContains(t, err, why)
}

// TestSymlinkedRecordsFile: a records file planted as a symbolic link to a
// file outside the directory (or to a name there that does not exist yet)
// is never followed: Open fails naming the link, the target is neither
// written, truncated, preallocated nor created; the same with the
// directory opened read-only (its file served as it is).
func TestSymlinkedRecordsFile(t *testing.T) {
	for _, tc := range []struct {
		name     string
		readOnly bool
		direct   DirectMode
	}{{"read-write", false, DirectAuto}, {"read-write-buffered", false, DirectOff}, {"read-only", true, DirectAuto}} {
		t.Run(tc.name, func(t *testing.T) {
			v := newVictim(t)
			dir := t.TempDir()
			cfg := config(dir, 8192, 16)
			cfg.Direct = tc.direct
			if tc.readOnly {
				cfg.faults = errOn(opOpen, unix.EROFS, func() bool { return true })
			}
			link := filepath.Join(dir, recordsName(SlotBytes(8192)))
			require.NoError(t, os.Symlink(v.path, link))
			requireUnsafe(t, cfg, link, "symbolic link")
			v.requireUnchanged(t)

			// A dangling link: its target is not created.
			require.NoError(t, os.Remove(link))
			absent := filepath.Join(t.TempDir(), "not-there")
			require.NoError(t, os.Symlink(absent, link))
			requireUnsafe(t, cfg, link, "symbolic link")
			_, err := os.Lstat(absent)
			require.ErrorIs(t, err, os.ErrNotExist, "the link's target was not created")
		})
	}
}

// TestSymlinkedHolderFile: kvoffload.holder planted as a link to a file
// outside the directory is never written through (Open fails naming it,
// the target unchanged), and never read through for ErrLocked's message.
func TestSymlinkedHolderFile(t *testing.T) {
	v := newVictim(t)
	dir := t.TempDir()
	cfg := config(dir, 8192, 16)
	link := filepath.Join(dir, holderFile)
	require.NoError(t, os.Symlink(v.path, link))
	requireUnsafe(t, cfg, link, "symbolic link")
	v.requireUnchanged(t)
	_, err := os.Stat(filepath.Join(dir, recordsName(SlotBytes(8192))))
	require.ErrorIs(t, err, os.ErrNotExist, "no records file made in a directory refused")

	// A store holds the directory; a link planted as its holder file
	// afterwards is not read into the second Open's ErrLocked.
	require.NoError(t, os.Remove(link))
	s := open(t, cfg)
	require.NoError(t, os.Remove(link))
	require.NoError(t, os.Symlink(v.path, link))
	_, err = Open(cfg)
	require.ErrorIs(t, err, ErrLocked)
	require.NotContains(t, err.Error(), strings.TrimSpace(string(v.data)), "the target's content is not read")
	require.ErrorContains(t, err, "not read")
	require.NoError(t, s.Close())
	v.requireUnchanged(t)
	info := Inspect(dir)
	require.Empty(t, info.Holder, "no store holds it now")
}

// TestHardLinkedRecordsFile: a records file that is a hard link to a file
// outside the directory (one inode, two names) is refused, the other name's
// file unchanged; so are a FIFO (opened without blocking) and a directory
// of the records file's name.
func TestHardLinkedRecordsFile(t *testing.T) {
	v := newVictim(t)
	dir := filepath.Join(filepath.Dir(v.path), "store") // same file system as the victim
	require.NoError(t, os.Mkdir(dir, 0o700))
	cfg := config(dir, 8192, 16)
	name := filepath.Join(dir, recordsName(SlotBytes(8192)))
	require.NoError(t, os.Link(v.path, name))
	requireUnsafe(t, cfg, name, "2 hard links")
	v.requireUnchanged(t)

	require.NoError(t, os.Remove(name))
	require.NoError(t, unix.Mkfifo(name, 0o600))
	requireUnsafe(t, cfg, name, "not a regular file")
	ro := cfg
	ro.faults = errOn(opOpen, unix.EROFS, func() bool { return true })
	requireUnsafe(t, ro, name, "not a regular file") // O_RDONLY on a FIFO would block without O_NONBLOCK

	require.NoError(t, os.Remove(name))
	require.NoError(t, os.Mkdir(name, 0o700))
	_, err := Open(cfg)
	require.ErrorIs(t, err, ErrNoUsableDir)
	require.ErrorContains(t, err, name)
}

// TestSymlinkedDirectory: the directory itself may be a symbolic link (the
// operator's choice of where records live); the files inside are the
// link target's, opened without following links.
func TestSymlinkedDirectory(t *testing.T) {
	real := t.TempDir()
	link := filepath.Join(t.TempDir(), "records-dir")
	require.NoError(t, os.Symlink(real, link))
	cfg := config(link, 8192, 16)
	s := open(t, cfg)
	require.NoError(t, s.Put(key(1), payload(key(1), 8192)))
	require.NoError(t, s.Close())
	_, err := os.Stat(filepath.Join(real, recordsName(SlotBytes(8192))))
	require.NoError(t, err)
	s = open(t, cfg)
	mustGet(t, s, key(1))
}

// TestInspectSymlink: Inspect reads no file through a link planted in
// the directory: the link is reported as an error, its target unread.
func TestInspectSymlink(t *testing.T) {
	v := newVictim(t)
	dir := t.TempDir()
	link := filepath.Join(dir, recordsName(SlotBytes(8192)))
	require.NoError(t, os.Symlink(v.path, link))
	info := Inspect(dir)
	require.Contains(t, info.Error, link)
	require.Contains(t, info.Error, "symbolic link")
	require.Empty(t, info.Files)
	v.requireUnchanged(t)
	require.False(t, bytes.Contains([]byte(info.Error), v.data))
}
