package disk

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/kvoffload/kvoffload/internal/tier/record"
	"golang.org/x/sys/unix"
)

// holderFile, in each directory, names the process that holds its lock.
const holderFile = "kvoffload.holder"

// scanWorkers is how many header reads the start-up scan keeps in flight:
// queue depth is what makes a scan fast on NVMe and virtio disks.
const scanWorkers = 32

// dirFile is one directory's records file.
type dirFile struct {
	dir      string
	name     string // the records file's name in dir
	path     string
	fd       int
	lockFd   int
	direct   bool
	writable bool
	first    int32 // the store's slot id of this file's slot 0
	n        int32 // slots in this file
}

// recordsName is the records file's name: the slot size is in it, so a
// store of another record size never reads this one's file.
func recordsName(slotBytes int64) string { return fmt.Sprintf("records-%d.kvo", slotBytes) }

// lockDir takes an exclusive flock on dir itself (which works in a read-only
// directory too) and records this process as the holder. dir may itself be
// a symbolic link (the design leaves where a directory lives to its
// operator); the files inside it are never followed: every one is opened
// relative to the locked directory's descriptor with O_NOFOLLOW
// (files.go), so a link planted there fails the open instead of sending a
// write outside the directory.
func lockDir(dir string) (int, error) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, opError("open directory", dir, err)
	}
	if err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB); err != nil {
		defer unix.Close(fd)
		if errors.Is(err, unix.EWOULDBLOCK) {
			return -1, fmt.Errorf("%w: %s is held by %s", ErrLocked, dir, readHolder(fd))
		}
		return -1, opError("flock", dir, err)
	}
	host, _ := os.Hostname()
	info := fmt.Sprintf("pid %d on %s since %s\n", os.Getpid(), host, time.Now().UTC().Format(time.RFC3339))
	if err := writeHolder(fd, dir, info); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// openDir locks dir and opens (creating and sizing when it can) its records
// file of n slots. A directory that refuses writes is opened read-only when
// its file exists. It returns the file and the size the file had before
// (records past it are torn). Records files of other slot sizes (other
// layouts) are left as they are, but for those Config.RemoveRecords names.
func (s *Store) openDir(dir string, n int32) (*dirFile, int64, error) {
	lockFd, err := lockDir(dir)
	if err != nil {
		return nil, 0, err
	}
	name := recordsName(s.slotBytes)
	d := &dirFile{dir: dir, name: name, path: filepath.Join(dir, name), fd: -1, lockFd: lockFd, n: n}
	fail := func(err error) (*dirFile, int64, error) {
		d.close()
		return nil, 0, err
	}
	if err := removeRecords(lockFd, dir, s.cfg.RemoveRecords); err != nil {
		return fail(err)
	}
	d.writable = true
	if err := s.cfg.faults.inject(opOpen, dir); err != nil {
		if !isReadOnly(err) {
			return fail(opError("open", d.path, err))
		}
		d.writable = false
	}
	if err := d.openFile(s.cfg.Direct, s.cfg.faults); err != nil {
		if !d.writable || !isReadOnly(err) {
			return fail(err)
		}
		d.writable = false
		if err := d.openFile(s.cfg.Direct, s.cfg.faults); err != nil {
			return fail(err)
		}
	}
	var st unix.Stat_t
	if err := unix.Fstat(d.fd, &st); err != nil {
		return fail(opError("stat", d.path, err))
	}
	want := int64(n) * s.slotBytes
	if !d.writable {
		d.n = int32(min(st.Size/s.slotBytes, int64(n)))
		return d, st.Size, nil
	}
	if st.Size > want {
		if err := unix.Ftruncate(d.fd, want); err != nil {
			return fail(opError("truncate", d.path, err))
		}
	}
	err = s.cfg.faults.inject(opFallocate, dir)
	if err == nil {
		err = unix.Fallocate(d.fd, 0, 0, want)
	}
	if err != nil {
		if !errors.Is(err, unix.EOPNOTSUPP) {
			return fail(fmt.Errorf("%w%s", opError(fmt.Sprintf("fallocate %d bytes of", want), d.path, err), otherLayouts(lockFd, dir, name, err)))
		}
		if err := unix.Ftruncate(d.fd, want); err != nil {
			return fail(opError("extend", d.path, err))
		}
	}
	return d, st.Size, nil
}

// openFile opens the records file, with O_DIRECT as mode allows, then
// probes a direct read (some file systems accept the flag and refuse the
// I/O). A read-only dirFile opens the file as it is, without creating it.
// The file is opened relative to the locked directory, never through a
// symbolic link, and must be a regular file of one link (openIn).
func (d *dirFile) openFile(mode DirectMode, f *faults) error {
	flags := unix.O_RDWR | unix.O_CREAT
	if !d.writable {
		flags = unix.O_RDONLY
	}
	if mode != DirectOff {
		fd, err := openIn(d.lockFd, d.dir, d.name, flags|unix.O_DIRECT, 0o600)
		if err == nil {
			if ferr := f.inject(opOpenDirect, d.dir); ferr != nil {
				unix.Close(fd)
				fd, err = -1, ferr
			}
		}
		if err == nil {
			hdr := headerBufs.Get().(*[]byte)
			_, perr := unix.Pread(fd, *hdr, 0)
			headerBufs.Put(hdr)
			if perr == nil {
				d.fd, d.direct = fd, true
				return nil
			}
			unix.Close(fd)
			err = perr
		}
		if errors.Is(err, ErrUnsafeFile) {
			return err
		}
		if !errors.Is(err, unix.EINVAL) {
			return opError("open", d.path, err)
		}
		if mode == DirectRequire {
			return fmt.Errorf("%w: %s: %v", ErrDirectUnsupported, d.path, err)
		}
	}
	fd, err := openIn(d.lockFd, d.dir, d.name, flags, 0o600)
	if err != nil {
		if errors.Is(err, ErrUnsafeFile) {
			return err
		}
		return opError("open", d.path, err)
	}
	d.fd = fd
	return nil
}

func (d *dirFile) close() {
	if d.fd >= 0 {
		unix.Close(d.fd)
		d.fd = -1
	}
	if d.lockFd >= 0 {
		unix.Close(d.lockFd) // releases the flock
		d.lockFd = -1
	}
}

// scanResult is what the start-up scan found in one slot.
type scanResult struct {
	key  [16]byte
	kind uint8
}

const (
	scanEmpty uint8 = iota // never written, or invalidated
	scanValid
	scanTorn  // a damaged header, or a payload past the file's old end
	scanStale // another format version, fingerprint, layout version or size
)

// scanChunk is the most a scan worker reads at once when records are small
// (slots of at most scanWholeMax bytes): whole runs of slots, headers and
// payloads, in one read each, instead of one header read per slot. A read
// of a small slot's payload costs less than a read of its own (the device
// moves bytes far faster than it serves I/Os), and the I/Os are scanChunk /
// slotBytes times fewer.
const scanChunk = 1 << 20

// scanWholeMax is the largest slot read whole by the scan (a variable for
// the tests, which run both ways).
var scanWholeMax int64 = 4 * record.HeaderSize

// scanBufs holds the scan workers' chunk buffers (aligned for O_DIRECT).
var scanBufs = sync.Pool{New: func() any { b := alignedBuf(scanChunk); return &b }}

// scan reads every slot's header of d and classifies it: scanWorkers
// goroutines, each reading its own contiguous run of slots in file order
// (10-20% faster here than handing out slots one at a time), small slots
// a chunk of them per read (scanChunk). Records whose payload ends past
// oldSize (the file was truncated) are torn.
func (s *Store) scan(d *dirFile, oldSize int64) ([]scanResult, error) {
	res := make([]scanResult, d.n)
	var firstErr error
	var errOnce sync.Once
	var wg sync.WaitGroup
	workers := min(scanWorkers, int(d.n))
	perRead := int64(1)
	if s.slotBytes <= scanWholeMax {
		perRead = scanChunk / s.slotBytes
	}
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lo, hi := int64(d.n)*int64(w)/int64(workers), int64(d.n)*int64(w+1)/int64(workers)
			if perRead == 1 {
				hdr := headerBufs.Get().(*[]byte)
				defer headerBufs.Put(hdr)
				for i := lo; i < hi; i++ {
					off := i * s.slotBytes
					if off+record.HeaderSize > oldSize {
						continue // past the old end: zeros, so empty
					}
					if err := preadFull(d.fd, [][]byte{*hdr}, off); err != nil {
						errOnce.Do(func() { firstErr = opError("read header of", d.path, err) })
						return
					}
					res[i] = s.classify(*hdr, off, oldSize)
				}
				return
			}
			buf := scanBufs.Get().(*[]byte)
			defer scanBufs.Put(buf)
			for i := lo; i < hi; i += perRead {
				off := i * s.slotBytes
				if off+record.HeaderSize > oldSize {
					break // past the old end: zeros, so empty
				}
				// Whole slots, but not past the old end (a multiple of
				// align: the file grows by whole slots).
				n := min(hi-i, perRead) * s.slotBytes
				n = min(n, (oldSize-off)/align*align)
				chunk := (*buf)[:n]
				if err := preadFull(d.fd, [][]byte{chunk}, off); err != nil {
					errOnce.Do(func() { firstErr = opError("read headers of", d.path, err) })
					return
				}
				for j := int64(0); j*s.slotBytes+record.HeaderSize <= n; j++ {
					res[i+j] = s.classify(chunk[j*s.slotBytes:], off+j*s.slotBytes, oldSize)
				}
			}
		}()
	}
	wg.Wait()
	return res, firstErr
}

var zeroHeader [record.HeaderLen]byte

func (s *Store) classify(hdr []byte, off, oldSize int64) scanResult {
	if bytes.Equal(hdr[:record.HeaderLen], zeroHeader[:]) {
		return scanResult{kind: scanEmpty}
	}
	h, err := record.DecodeHeader(hdr)
	switch {
	case errors.Is(err, record.ErrVersion):
		return scanResult{kind: scanStale}
	case err != nil:
		return scanResult{kind: scanTorn}
	case h.Check(s.cfg.Fingerprint, record.HostLayoutVersion) != nil, h.PayloadLen != uint64(s.cfg.RecordPayloadBytes):
		return scanResult{kind: scanStale}
	case off+record.HeaderSize+s.cfg.RecordPayloadBytes > oldSize:
		return scanResult{kind: scanTorn}
	}
	return scanResult{key: h.Key, kind: scanValid}
}
