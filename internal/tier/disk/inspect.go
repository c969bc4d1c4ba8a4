package disk

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"

	"github.com/kvoffload/kvoffload/internal/tier/record"
	"golang.org/x/sys/unix"
)

// DirInfo is what Inspect found in a directory. Inspect changes nothing
// there (unlike Open, which creates and sizes its records file, and removes those RemoveRecords names).
type DirInfo struct {
	Dir string `json:"dir"`
	// Mode is the I/O Open would use with DirectAuto: "direct" when the
	// file system takes O_DIRECT, "buffered" when it refuses it, "unknown"
	// when it could not be probed (no records file and a directory that
	// refuses writes).
	Mode string `json:"mode"`
	// Writable: the directory takes new files (Open would write records
	// there, not only serve them).
	Writable bool `json:"writable"`
	// Holder names the process holding the directory's lock (a store is
	// open on it), "" when none does.
	Holder string     `json:"holder,omitempty"`
	Files  []FileInfo `json:"files,omitempty"`
	// Error is why the directory could not be read, "" when it was.
	Error string `json:"error,omitempty"`
}

// FileInfo describes one records file.
type FileInfo struct {
	Path      string `json:"path"`
	SlotBytes int64  `json:"slot_bytes"` // file space per record (from the name)
	FileBytes int64  `json:"file_bytes"`
	// CapacityRecords is how many records the file holds as sized now.
	CapacityRecords int64 `json:"capacity_records"`
	// Records counts the headers that pass their checks, by fingerprint
	// (hex): Open serves those of its own fingerprint and reuses the
	// others' slots. Payloads are not verified (Get does that).
	Records map[string]int64 `json:"records,omitempty"`
	// Damaged counts headers that fail their checks (torn or of another
	// format version); empty slots are not counted.
	Damaged int64 `json:"damaged"`
}

// Inspect reports what dir holds and how Open would use it, reading only:
// the records files' headers, the holder file, and an O_DIRECT probe (of a
// records file, or of a temporary file it removes when there is none).
// It never fails; what it cannot read is in DirInfo.Error.
func Inspect(dir string) DirInfo {
	info := DirInfo{Dir: dir, Mode: "unknown"}
	st, err := os.Stat(dir)
	if err != nil {
		info.Error = err.Error()
		return info
	}
	if !st.IsDir() {
		info.Error = fmt.Sprintf("%s is not a directory", dir)
		return info
	}
	info.Writable = unix.Access(dir, unix.W_OK) == nil
	dirFd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		info.Error = opError("open directory", dir, err).Error()
		return info
	}
	defer unix.Close(dirFd) // releases the shared lock, if taken
	if err := unix.Flock(dirFd, unix.LOCK_SH|unix.LOCK_NB); errors.Is(err, unix.EWOULDBLOCK) {
		info.Holder = readHolder(dirFd)
	}
	paths, _ := filepath.Glob(filepath.Join(dir, "records-*.kvo"))
	sort.Strings(paths)
	for _, p := range paths {
		name := filepath.Base(p)
		slot, ok := parseRecordsName(name)
		if !ok {
			continue
		}
		fi, err := inspectFile(dirFd, dir, name, slot)
		if err != nil {
			info.Error = err.Error()
			continue
		}
		info.Files = append(info.Files, fi)
		if info.Mode == "unknown" {
			info.Mode = directProbe(dirFd, dir, name)
		}
	}
	if info.Mode == "unknown" && info.Writable {
		if f, err := os.CreateTemp(dir, ".kvoffload-probe-*"); err == nil {
			name := f.Name()
			f.Close()
			info.Mode = directProbe(dirFd, dir, filepath.Base(name))
			os.Remove(name)
		}
	}
	return info
}

// directProbe opens path with O_DIRECT and reads its first sector, as Open's
// DirectAuto does: "direct" when that works, "buffered" when the file
// system refuses it (EINVAL), "unknown" otherwise.
// The file is opened as Open would (openIn: never through a link).
func directProbe(dirFd int, dir, name string) string {
	fd, err := openIn(dirFd, dir, name, unix.O_RDONLY|unix.O_DIRECT, 0)
	if err == nil {
		hdr := headerBufs.Get().(*[]byte)
		_, err = unix.Pread(fd, *hdr, 0)
		headerBufs.Put(hdr)
		unix.Close(fd)
	}
	switch {
	case err == nil:
		return "direct"
	case errors.Is(err, unix.EINVAL):
		return "buffered"
	}
	return "unknown"
}

// inspectFile reads every slot's header of the records file name in the
// directory open at dirFd (opened as Open would: never through a link).
func inspectFile(dirFd int, dir, name string, slot int64) (FileInfo, error) {
	path := filepath.Join(dir, name)
	fd, err := openIn(dirFd, dir, name, unix.O_RDONLY, 0)
	if err != nil {
		if errors.Is(err, ErrUnsafeFile) {
			return FileInfo{}, err
		}
		return FileInfo{}, opError("open", path, err)
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return FileInfo{}, err
	}
	fi := FileInfo{Path: path, SlotBytes: slot, FileBytes: st.Size(), CapacityRecords: st.Size() / slot}
	hdr := make([]byte, record.HeaderSize)
	for i := int64(0); i < fi.CapacityRecords; i++ {
		if _, err := f.ReadAt(hdr, i*slot); err != nil {
			return fi, fmt.Errorf("disk: read header of %s: %w", path, err)
		}
		if string(hdr[:record.HeaderLen]) == string(zeroHeader[:]) {
			continue
		}
		h, err := record.DecodeHeader(hdr)
		if err != nil || SlotBytes(int64(h.PayloadLen)) != slot {
			fi.Damaged++
			continue
		}
		if fi.Records == nil {
			fi.Records = map[string]int64{}
		}
		fi.Records[fmt.Sprintf("%016x", h.Fingerprint)]++
	}
	return fi, nil
}
