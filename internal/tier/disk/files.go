package disk

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/kvoffload/kvoffload/internal/tier/record"
	"golang.org/x/sys/unix"
)

// ErrUnsafeFile: a file the store would open in its directory is a
// symbolic link, not a regular file, or a regular file with more than one
// link; the message names it. The store never follows a link inside its
// directories (a planted link would send its writes, truncation and
// preallocation to a file outside them) and never writes a file another
// name shares.
var ErrUnsafeFile = errors.New("disk: unsafe file in the directory")

// openIn opens name in the directory open at dirFd (dir is its name, for
// messages) with O_NOFOLLOW: a symbolic link there is ErrUnsafeFile, never
// followed, and so is anything but a regular file of one link (a FIFO is
// opened without blocking, a terminal without becoming the controlling
// one, then refused). The descriptor is close-on-exec and blocking.
func openIn(dirFd int, dir, name string, flags int, mode uint32) (int, error) {
	path := filepath.Join(dir, name)
	fd, err := unix.Openat(dirFd, name, flags|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, mode)
	if err != nil {
		if errors.Is(err, unix.ELOOP) {
			return -1, fmt.Errorf("%w: %s is a symbolic link; the disk tier never follows links in its directory (remove it)", ErrUnsafeFile, path)
		}
		return -1, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return -1, err
	}
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFREG:
		unix.Close(fd)
		return -1, fmt.Errorf("%w: %s is not a regular file (file mode %#o)", ErrUnsafeFile, path, st.Mode&unix.S_IFMT)
	case st.Nlink > 1:
		unix.Close(fd)
		return -1, fmt.Errorf("%w: %s has %d hard links; the disk tier writes only files no other name shares", ErrUnsafeFile, path, st.Nlink)
	}
	fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	if err == nil {
		_, err = unix.FcntlInt(uintptr(fd), unix.F_SETFL, fl&^unix.O_NONBLOCK)
	}
	if err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// readHolder returns what the holder file of the directory open at dirFd
// says (at most 512 bytes), "unknown holder" when it cannot be read. A
// holder file that is a link is not read.
func readHolder(dirFd int) string {
	fd, err := openIn(dirFd, "", holderFile, unix.O_RDONLY, 0)
	if err != nil {
		if errors.Is(err, ErrUnsafeFile) {
			return "unknown holder (" + holderFile + " is not a plain file: not read)"
		}
		return "unknown holder"
	}
	defer unix.Close(fd)
	b := make([]byte, 512)
	n, _ := io.ReadFull(fdReader(fd), b)
	if h := strings.TrimSpace(string(b[:n])); h != "" {
		return h
	}
	return "unknown holder"
}

// fdReader reads a descriptor from its current offset.
type fdReader int

func (r fdReader) Read(p []byte) (int, error) {
	n, err := unix.Read(int(r), p)
	switch {
	case err != nil:
		return 0, err
	case n == 0:
		return 0, io.EOF
	}
	return n, nil
}

// writeHolder records info in the holder file of the directory open at
// dirFd. It is best effort (a directory that refuses writes keeps no
// holder), except that a holder file that is a link, or not a regular file
// of one link, is ErrUnsafeFile: the directory is not used.
func writeHolder(dirFd int, dir, info string) error {
	fd, err := openIn(dirFd, dir, holderFile, unix.O_WRONLY|unix.O_CREAT, 0o600)
	if err != nil {
		if errors.Is(err, ErrUnsafeFile) {
			return err
		}
		return nil
	}
	defer unix.Close(fd)
	if unix.Ftruncate(fd, 0) == nil {
		_ = pwriteFull(fd, [][]byte{[]byte(info)}, 0)
	}
	return nil
}

// parseRecordsName returns the slot size a records file's name gives
// (records-<slot bytes>.kvo, as recordsName writes it), false for any other
// name.
func parseRecordsName(name string) (int64, bool) {
	var slot int64
	if _, err := fmt.Sscanf(name, "records-%d.kvo", &slot); err != nil || recordsName(slot) != name {
		return 0, false
	}
	return slot, slot > record.HeaderSize && slot%align == 0
}

// checkRemoveRecords validates Config.RemoveRecords for a store of
// slotBytes slots: each a records file's name, none this store's own.
func checkRemoveRecords(names []string, slotBytes int64) error {
	for _, n := range names {
		slot, ok := parseRecordsName(n)
		switch {
		case !ok:
			return fmt.Errorf("%w: RemoveRecords %q is not the name of a records file (records-<slot bytes>.kvo, a multiple of 4096 above %d)", ErrConfig, n, record.HeaderSize)
		case slot == slotBytes:
			return fmt.Errorf("%w: RemoveRecords %q is this store's own records file (slots of %d bytes)", ErrConfig, n, slotBytes)
		}
	}
	return nil
}

// removeRecords removes the records files names (checked by
// checkRemoveRecords) from the directory open at dirFd: those of other
// layouts that the configuration asked to remove. A name not there is
// skipped; a link of that name is removed, never its target.
func removeRecords(dirFd int, dir string, names []string) error {
	for _, n := range names {
		if err := unix.Unlinkat(dirFd, n, 0); err != nil && !errors.Is(err, unix.ENOENT) {
			return opError("remove (RemoveRecords)", filepath.Join(dir, n), err)
		}
	}
	return nil
}

// otherLayouts describes, for an error that is ENOSPC or EDQUOT, the
// records files of other slot sizes in the directory open at dirFd: the
// space other layouts' records keep, which Open leaves unless
// RemoveRecords names them. "" for other errors or when there are none.
func otherLayouts(dirFd int, dir, own string, err error) string {
	if !isNoSpace(err) {
		return ""
	}
	entries, rerr := os.ReadDir(dir)
	if rerr != nil {
		return ""
	}
	var others []string
	for _, e := range entries {
		n := e.Name()
		if _, ok := parseRecordsName(n); !ok || n == own {
			continue
		}
		var st unix.Stat_t
		if unix.Fstatat(dirFd, n, &st, unix.AT_SYMLINK_NOFOLLOW) != nil {
			continue
		}
		others = append(others, fmt.Sprintf("%s (%d bytes)", n, st.Size))
	}
	if len(others) == 0 {
		return ""
	}
	sort.Strings(others)
	return fmt.Sprintf("; the directory also holds the records of other layouts, kept: %s (RemoveRecords names those to remove)", strings.Join(others, ", "))
}
