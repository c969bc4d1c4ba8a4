package disk

import (
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvoffload/kvoffload/internal/tier/record"
	"golang.org/x/sys/unix"
)

// bounceBuffers bounds the aligned copies made for callers whose buffers
// O_DIRECT cannot use (the engine's pinned slots never need one).
const bounceBuffers = 4

// Slot states.
const (
	slotFree    uint8 = iota // on the free list (writable directories only)
	slotWriting              // a Put is writing it; its key is indexed
	slotReady                // readable; in the LRU list if its directory is writable
	slotGone                 // out of the index, waiting for its readers
)

// slot is the store's memory of one record slot.
type slot struct {
	key        [16]byte
	state      uint8
	dead       bool // slotWriting: deleted meanwhile; released when the write ends
	wipe       bool // invalidate (or punch) on disk when released
	dir        uint16
	readers    int32
	prev, next int32 // LRU links, -1 for none; head is the most recent
}

// Store is a disk store of fixed-size records keyed by 16-byte keys. Its
// methods are safe for concurrent use by many goroutines: each Put and Get
// does its own pwrite or preads, and the one mutex guards only the index,
// never I/O. See the package documentation for what it guarantees.
type Store struct {
	cfg       Config
	slotBytes int64 // header sector + payload rounded up to 4 KiB
	padded    int64 // payload rounded up to 4 KiB
	dirs      []*dirFile
	bounce    *bouncePool

	mu       sync.Mutex
	index    map[[16]byte]int32
	slots    []slot
	free     []int32
	lruHead  int32
	lruTail  int32
	ready    int64
	closed   bool
	inflight sync.WaitGroup

	hits, misses, corrupt, ioErrors, noSpace, evictions, dropped atomic.Int64
	torn, stale                                                  int64
	readOnlyDirs                                                 int
	unusable                                                     []error
}

// SlotBytes returns the file space one record takes: the header sector and
// the payload rounded up to 4 KiB.
func SlotBytes(recordPayloadBytes int64) int64 {
	return record.HeaderSize + roundUp(recordPayloadBytes, align)
}

// Open locks each directory of cfg.Dirs, opens or creates its records file
// (preallocated, mode 0600), and rebuilds the index from the records'
// headers, discarding torn ones and those of another format version,
// fingerprint or record size. A directory that refuses writes serves the
// records it holds and takes no new ones; one that cannot be used at all is
// left out (Stats.UnusableDirs) unless none can be used (ErrNoUsableDir).
// A directory held by another store is an error (ErrLocked).
func Open(cfg Config) (*Store, error) {
	if len(cfg.Dirs) == 0 || len(cfg.Dirs) > 1<<16 {
		return nil, fmt.Errorf("%w: %d directories, need 1 to %d", ErrConfig, len(cfg.Dirs), 1<<16)
	}
	if cfg.RecordPayloadBytes < 1 || cfg.RecordPayloadBytes > record.MaxPayloadBytes {
		return nil, fmt.Errorf("%w: RecordPayloadBytes = %d, need 1 to %d", ErrConfig, cfg.RecordPayloadBytes, int64(record.MaxPayloadBytes))
	}
	if cfg.Fsync > FsyncOnClose || cfg.Direct > DirectOff {
		return nil, fmt.Errorf("%w: Fsync %v, Direct %v", ErrConfig, cfg.Fsync, cfg.Direct)
	}
	if cfg.Faults != nil && cfg.faults == nil {
		fn := cfg.Faults
		cfg.faults = &faults{fn: func(op faultOp, dir string) error { return fn(FaultOp(op), dir) }}
	}
	s := &Store{cfg: cfg, padded: roundUp(cfg.RecordPayloadBytes, align), lruHead: -1, lruTail: -1}
	s.slotBytes = record.HeaderSize + s.padded
	total := cfg.CapacityBytes / s.slotBytes
	if total < int64(len(cfg.Dirs)) || total > 1<<31-1 {
		return nil, fmt.Errorf("%w: CapacityBytes = %d holds %d records of %d bytes; need 1 to %d per directory",
			ErrConfig, cfg.CapacityBytes, total, s.slotBytes, (1<<31-1)/len(cfg.Dirs))
	}
	if err := checkRemoveRecords(cfg.RemoveRecords, s.slotBytes); err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	for _, dir := range cfg.Dirs {
		abs, err := filepath.Abs(dir)
		if err != nil {
			return nil, fmt.Errorf("%w: directory %q: %v", ErrConfig, dir, err)
		}
		if seen[abs] {
			return nil, fmt.Errorf("%w: directory %s listed twice", ErrConfig, abs)
		}
		seen[abs] = true
	}

	// Open (lock, create, size) the directories in turn, then scan their
	// files at once: each file's header reads are a queue of their own.
	type opened struct {
		d       *dirFile
		oldSize int64
		res     []scanResult
		err     error
	}
	var ods []*opened
	for i, dir := range cfg.Dirs {
		n := int32(total / int64(len(cfg.Dirs)))
		if int64(i) < total%int64(len(cfg.Dirs)) {
			n++
		}
		d, oldSize, err := s.openDir(dir, n)
		if err != nil {
			if errors.Is(err, ErrLocked) || errors.Is(err, ErrDirectUnsupported) {
				for _, od := range ods {
					od.d.close()
				}
				return nil, err
			}
			s.unusable = append(s.unusable, err)
			continue
		}
		ods = append(ods, &opened{d: d, oldSize: oldSize})
	}
	var wg sync.WaitGroup
	for _, od := range ods {
		wg.Add(1)
		go func() {
			defer wg.Done()
			od.res, od.err = s.scan(od.d, od.oldSize)
		}()
	}
	wg.Wait()
	var scans [][]scanResult
	valid := 0
	for _, od := range ods {
		if od.err != nil {
			od.d.close()
			s.unusable = append(s.unusable, od.err)
			continue
		}
		d := od.d
		d.first = int32(len(s.slots))
		s.slots = append(s.slots, make([]slot, d.n)...)
		s.dirs = append(s.dirs, d)
		scans = append(scans, od.res)
		for _, r := range od.res {
			if r.kind == scanValid {
				valid++
			}
		}
	}
	if len(s.dirs) == 0 {
		return nil, fmt.Errorf("%w: %w", ErrNoUsableDir, errors.Join(s.unusable...))
	}
	s.index = make(map[[16]byte]int32, valid)
	for di, d := range s.dirs {
		if !d.writable {
			s.readOnlyDirs++
		}
		for j := range scans[di] {
			i := d.first + int32(j)
			sl := &s.slots[i]
			sl.dir, sl.prev, sl.next = uint16(di), -1, -1
			r := scans[di][j]
			switch r.kind {
			case scanTorn:
				s.torn++
			case scanStale:
				s.stale++
			}
			if _, dup := s.index[r.key]; r.kind != scanValid || dup {
				if r.kind == scanValid {
					s.stale++ // a second copy of a key (a slot a crash left half rewritten, then the key stored again): the first found is kept
				}
				if d.writable {
					s.free = append(s.free, i)
				}
				continue
			}
			sl.key, sl.state = r.key, slotReady
			s.index[r.key] = i
			s.ready++
			if d.writable {
				s.lruPush(i)
			}
		}
	}
	s.orderFree()
	s.bounce = newBouncePool(int(s.slotBytes), bounceBuffers)
	return s, nil
}

// orderFree orders the free list (a stack) so that Puts fill each file from
// its start, in file order, taking the directories in turn.
func (s *Store) orderFree() {
	perDir := make([][]int32, len(s.dirs))
	for _, i := range s.free {
		perDir[s.slots[i].dir] = append(perDir[s.slots[i].dir], i)
	}
	n := len(s.free)
	order := s.free[:0]
	for k := 0; len(order) < n; k++ {
		for _, f := range perDir {
			if k < len(f) {
				order = append(order, f[k])
			}
		}
	}
	slices.Reverse(order)
	s.free = order
}

func (s *Store) closeDirs() {
	for _, d := range s.dirs {
		d.close()
	}
}

// lruPush makes slot i the most recent.
func (s *Store) lruPush(i int32) {
	sl := &s.slots[i]
	sl.prev, sl.next = -1, s.lruHead
	if s.lruHead >= 0 {
		s.slots[s.lruHead].prev = i
	}
	s.lruHead = i
	if s.lruTail < 0 {
		s.lruTail = i
	}
}

// lruRemove takes slot i out of the LRU list if it is there.
func (s *Store) lruRemove(i int32) {
	sl := &s.slots[i]
	if sl.prev < 0 && s.lruHead != i {
		return
	}
	if sl.prev >= 0 {
		s.slots[sl.prev].next = sl.next
	} else {
		s.lruHead = sl.next
	}
	if sl.next >= 0 {
		s.slots[sl.next].prev = sl.prev
	} else {
		s.lruTail = sl.prev
	}
	sl.prev, sl.next = -1, -1
}

func (s *Store) writable(i int32) bool { return s.dirs[s.slots[i].dir].writable }

// begin registers an operation that Close waits for; false once closed.
func (s *Store) begin() bool {
	if s.closed {
		return false
	}
	s.inflight.Add(1)
	return true
}

// unindex takes ready slot i out of the index (with s.mu held) and reports
// whether the caller must release it now (no reader left).
func (s *Store) unindex(i int32, wipe bool) bool {
	sl := &s.slots[i]
	if s.index[sl.key] == i {
		delete(s.index, sl.key)
	}
	s.lruRemove(i)
	s.ready--
	sl.state = slotGone
	sl.wipe = sl.wipe || wipe
	return sl.readers == 0
}

// release wipes slot i on disk if it is marked so, then frees it. Called
// without s.mu, by whoever dropped the slot's last use.
func (s *Store) release(i int32) {
	sl := &s.slots[i]
	d := s.dirs[sl.dir]
	if sl.wipe && d.writable {
		s.wipeSlot(d, int64(i-d.first)*s.slotBytes)
	}
	s.mu.Lock()
	s.freeSlot(i)
	s.mu.Unlock()
}

// freeSlot returns slot i to the free list (with s.mu held).
func (s *Store) freeSlot(i int32) {
	sl := &s.slots[i]
	sl.state, sl.dead, sl.wipe, sl.key = slotFree, false, false, [16]byte{}
	if s.writable(i) {
		s.free = append(s.free, i)
	}
}

// wipeSlot makes the record at off unreadable after a restart: with
// ZeroOnRelease it punches the whole slot (or writes zeros over it),
// otherwise it zeroes the header sector. Failures are counted: a surviving
// record is still verified by whoever reads it.
func (s *Store) wipeSlot(d *dirFile, off int64) {
	if s.cfg.ZeroOnRelease {
		err := unix.Fallocate(d.fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, s.slotBytes)
		if err == nil {
			return
		}
		if !errors.Is(err, unix.EOPNOTSUPP) {
			s.ioErrors.Add(1)
			return
		}
		b := s.bounce.get()
		clear(b)
		if err := pwriteFull(d.fd, [][]byte{b}, off); err != nil {
			s.ioErrors.Add(1)
		}
		s.bounce.put(b)
		return
	}
	hdr := headerBufs.Get().(*[]byte)
	clear(*hdr)
	if err := pwriteFull(d.fd, [][]byte{*hdr}, off); err != nil {
		s.ioErrors.Add(1)
	}
	headerBufs.Put(hdr)
}

// Put stores payload (exactly RecordPayloadBytes) under key. A key already
// stored (or being stored) is kept and Put returns nil. When no slot is
// free the least recently used record is evicted. The record goes to the
// kernel with O_DIRECT straight from payload when it is 4 KiB-aligned in
// address and length, through a bounce buffer otherwise: header and payload
// in one pwritev (one I/O), or with FsyncEach the payload, fdatasync, the
// header, fdatasync. The write stays inside the record's slot. A crash can
// leave a slot whose header and payload do not match (the payload checksum
// fails at the first Get) or a damaged header (discarded at Open); with
// FsyncEach a header on stable storage implies its payload is.
//
// Errors are for counting, never for retrying at once: ErrPayloadSize,
// ErrClosed, ErrFull (every slot busy), and ErrIO wrapping the errno (ENOSPC,
// EIO, EROFS...); the store stays usable after each.
func (s *Store) Put(key [16]byte, payload []byte) error {
	if int64(len(payload)) != s.cfg.RecordPayloadBytes {
		return fmt.Errorf("%w: payload of %d bytes, records hold %d", ErrPayloadSize, len(payload), s.cfg.RecordPayloadBytes)
	}
	s.mu.Lock()
	if !s.begin() {
		s.mu.Unlock()
		return ErrClosed
	}
	defer s.inflight.Done()
	if _, ok := s.index[key]; ok {
		s.mu.Unlock()
		return nil
	}
	i := int32(-1)
	if k := len(s.free); k > 0 {
		i = s.free[k-1]
		s.free = s.free[:k-1]
	} else {
		for v := s.lruTail; v >= 0; v = s.slots[v].prev {
			if s.slots[v].readers == 0 {
				s.removed(s.slots[v].key, true)
				s.unindex(v, false) // overwritten below: no wipe
				i = v
				s.evictions.Add(1)
				break
			}
		}
	}
	if i < 0 {
		s.mu.Unlock()
		s.dropped.Add(1)
		return ErrFull
	}
	sl := &s.slots[i]
	sl.key, sl.state, sl.dead, sl.wipe = key, slotWriting, false, false
	s.index[key] = i
	s.mu.Unlock()

	err := s.write(i, key, payload)

	s.mu.Lock()
	switch {
	case err != nil && s.cfg.ZeroOnRelease:
		// The slot may still hold the record this Put evicted (or part
		// of the new one): punch it before it is reused.
		if s.index[key] == i {
			delete(s.index, key)
		}
		sl.state, sl.wipe = slotGone, true
		s.mu.Unlock()
		s.release(i)
		s.mu.Lock()
	case err != nil:
		if s.index[key] == i {
			delete(s.index, key)
		}
		s.freeSlot(i)
	case sl.dead:
		sl.state, sl.wipe = slotGone, true
		s.mu.Unlock()
		s.release(i)
		return nil
	default:
		sl.state = slotReady
		s.ready++
		s.lruPush(i)
		if s.cfg.OnStore != nil {
			s.cfg.OnStore(key)
		}
	}
	s.mu.Unlock()
	if err != nil {
		s.ioErrors.Add(1)
		if isNoSpace(err) {
			s.noSpace.Add(1)
		}
		return fmt.Errorf("%w: %w", ErrIO, err)
	}
	return nil
}

// write writes slot i's record: header and payload in one pwritev, or with
// FsyncEach the payload, a flush, the header, a flush.
func (s *Store) write(i int32, key [16]byte, payload []byte) error {
	d := s.dirs[s.slots[i].dir]
	off := int64(i-d.first) * s.slotBytes
	if err := s.cfg.faults.inject(opWrite, d.dir); err != nil {
		return opError("write", d.path, err)
	}
	hdr := headerBufs.Get().(*[]byte)
	defer headerBufs.Put(hdr)
	record.EncodeHeader(*hdr, record.Header{
		LayoutVersion: record.HostLayoutVersion,
		Fingerprint:   s.cfg.Fingerprint,
		Key:           key,
		PayloadLen:    uint64(len(payload)),
		PayloadSum:    record.Checksum(payload),
	})
	body := payload
	if d.direct && !isAligned(payload) {
		b := s.bounce.get()
		defer s.bounce.put(b)
		n := copy(b, payload)
		clear(b[n:s.padded])
		body = b[:s.padded]
	}
	if s.cfg.Fsync != FsyncEach {
		if err := pwriteFull(d.fd, [][]byte{*hdr, body}, off); err != nil {
			return opError("write record to", d.path, err)
		}
		return nil
	}
	if err := pwriteFull(d.fd, [][]byte{body}, off+record.HeaderSize); err != nil {
		return opError("write payload to", d.path, err)
	}
	if err := fdatasync(d); err != nil {
		return err
	}
	if err := pwriteFull(d.fd, [][]byte{*hdr}, off); err != nil {
		return opError("write header to", d.path, err)
	}
	return fdatasync(d)
}

func fdatasync(d *dirFile) error {
	if err := unix.Fdatasync(d.fd); err != nil {
		return opError("fdatasync", d.path, err)
	}
	return nil
}

// Get reads key's payload into dst[:RecordPayloadBytes] and reports whether
// it found a record that passed every check: header checksum, format and
// host-layout version, fingerprint, key, length and payload checksum. A
// record that fails one, or an I/O error, is a miss counted in Stats
// (Corrupt, IOErrors) and the record is dropped: Get returns (false, nil).
// On a miss dst's contents are undefined. The read goes straight into dst
// with O_DIRECT when dst is 4 KiB-aligned and RecordPayloadBytes a multiple
// of 4 KiB, through a bounce buffer otherwise (dst is then written only on
// a hit). A payload of at least 1 MiB read with O_DIRECT is read in two
// preads in turn, the head's CRC running during the second (see read).
// Errors: ErrPayloadSize (dst too short), ErrClosed.
func (s *Store) Get(key [16]byte, dst []byte) (bool, error) {
	if int64(len(dst)) < s.cfg.RecordPayloadBytes {
		return false, fmt.Errorf("%w: destination of %d bytes, records hold %d", ErrPayloadSize, len(dst), s.cfg.RecordPayloadBytes)
	}
	dst = dst[:s.cfg.RecordPayloadBytes]
	s.mu.Lock()
	if !s.begin() {
		s.mu.Unlock()
		return false, ErrClosed
	}
	defer s.inflight.Done()
	i, ok := s.index[key]
	if !ok || s.slots[i].state != slotReady {
		s.mu.Unlock()
		s.misses.Add(1)
		return false, nil
	}
	sl := &s.slots[i]
	sl.readers++
	if s.writable(i) {
		s.lruRemove(i)
		s.lruPush(i)
	}
	s.mu.Unlock()

	ioErr, verr := s.read(i, key, dst)

	s.mu.Lock()
	sl.readers--
	bad := ioErr != nil || verr != nil
	releaseNow := false
	if bad && sl.state == slotReady {
		releaseNow = s.unindex(i, true)
		s.removed(key, false)
	} else if sl.state == slotGone && sl.readers == 0 {
		releaseNow = true
	}
	s.mu.Unlock()
	if releaseNow {
		s.release(i)
	}
	switch {
	case ioErr != nil:
		s.ioErrors.Add(1)
	case verr != nil:
		s.corrupt.Add(1)
	default:
		s.hits.Add(1)
		return true, nil
	}
	s.misses.Add(1)
	return false, nil
}

// read reads slot i into dst and verifies it: an I/O error, or a
// verification error (an I/O error of the tail's read is reported as one
// even if its verification failed too).
func (s *Store) read(i int32, key [16]byte, dst []byte) (ioErr, verr error) {
	d := s.dirs[s.slots[i].dir]
	off := int64(i-d.first) * s.slotBytes
	if err := s.cfg.faults.inject(opRead, d.dir); err != nil {
		return err, nil
	}
	hdr := headerBufs.Get().(*[]byte)
	defer headerBufs.Put(hdr)
	body := dst
	if d.direct && !isAligned(dst) {
		b := s.bounce.get()
		defer s.bounce.put(b)
		body = b[:s.padded]
	}
	payload := body[:len(dst)]
	sum := func() uint32 { return record.Checksum(payload) }
	head := body
	if t := s.readTail(d); t > 0 {
		// Two reads, one after the other (never both in flight): the
		// header sector and the head, then the tail while another
		// goroutine checksums the head, so that the CRC of a payload
		// fresh from the disk, in no cache, does not all wait for the
		// whole read. The head and the tail are checksummed only once
		// the header has passed (Accept calls sum last), and sum
		// returns only once both reads and the head's CRC are done.
		head = body[:len(body)-t]
		tail := body[len(head):]
		sum = func() uint32 {
			var headSum uint32
			var wg sync.WaitGroup
			wg.Go(func() { headSum = record.Checksum(head) })
			ioErr = s.pread(d, [][]byte{tail}, off+record.HeaderSize+int64(len(head)))
			wg.Wait()
			return record.ChecksumUpdate(headSum, payload[len(head):])
		}
	}
	if err := s.pread(d, [][]byte{*hdr, head}, off); err != nil {
		return err, nil
	}
	verr = record.Accept(*hdr, record.HeaderSize+len(dst), sum, s.cfg.Fingerprint, key, len(dst))
	if ioErr != nil || verr != nil {
		return ioErr, verr
	}
	if len(body) > 0 && &body[0] != &dst[0] {
		copy(dst, body)
	}
	return nil, nil
}

// pread is Get's preadFull, timed for readTimer when a test sets it.
func (s *Store) pread(d *dirFile, bufs [][]byte, off int64) error {
	if readTimer == nil {
		return preadFull(d.fd, bufs, off)
	}
	start := time.Now()
	err := preadFull(d.fd, bufs, off)
	readTimer(time.Since(start))
	return err
}

// readTimer, when a test sets it (before any Get), is given the time of
// each of Get's preads (TestDiskVsFio's Q=1 diagnosis).
var readTimer func(time.Duration)

// Get's split of a record read (see read): payloads of at least
// splitMinBytes read with O_DIRECT are read as the header sector and the
// head, then the last 1/splitTailDiv of the payload (rounded up to align)
// while another goroutine checksums the head. On the 2-CPU VM (2 MiB
// payloads, one Get at a time, alternated with one-read Gets in blocks of
// 8 records) the 256 KiB tail took about as long to read (0.4 ms) as the
// CRC of the cold 1.75 MiB head, and a second I/O cost 40-70 µs; Gets were
// 5-7% faster where a record's read took 2.3 ms or more, no faster where it
// took 1.7-2 ms. A quarter measured alike; equal pieces, or pieces all in
// flight at once, were slower than one read. On the H200 machine's virtio
// disk (c1fdfc1, Q=1 diagnosis) the head and tail in flight at once read
// 1.05 GB/s against the split's 1.29 (into a huge page 1.58 against 1.83).
var (
	splitMinBytes int64 = 1 << 20
	splitTailDiv  int64 = 8
)

// readTail returns how many bytes at the end of a slot read splits off as
// its second read, 0 for one read.
func (s *Store) readTail(d *dirFile) int {
	if !d.direct || splitMinBytes == 0 || s.cfg.RecordPayloadBytes < splitMinBytes {
		return 0
	}
	return int(roundUp(s.cfg.RecordPayloadBytes/splitTailDiv, align))
}

// Contains reports whether key has a readable record. It consults memory
// only, never the disk: a true answer can still be a miss in Get if the
// record turns out damaged or is evicted meanwhile.
func (s *Store) Contains(key [16]byte) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	i, ok := s.index[key]
	return ok && s.slots[i].state == slotReady
}

// Delete removes key's record, if any, and invalidates it on disk (punches
// it with ZeroOnRelease) so that it does not come back after a restart.
// A record being read is released when its last reader is done; one being
// written is released when the write ends.
func (s *Store) Delete(key [16]byte) {
	s.mu.Lock()
	if !s.begin() {
		s.mu.Unlock()
		return
	}
	defer s.inflight.Done()
	i, ok := s.index[key]
	releaseNow := ok && s.drop(i)
	s.mu.Unlock()
	if releaseNow {
		s.release(i)
	}
}

// removed reports key's record gone to Config.OnRemove (with s.mu held).
func (s *Store) removed(key [16]byte, evicted bool) {
	if s.cfg.OnRemove != nil {
		s.cfg.OnRemove(key, evicted)
	}
}

// drop takes slot i (indexed) out of the index for Delete or Clear, with
// s.mu held, and reports whether the caller must release it now.
func (s *Store) drop(i int32) bool {
	sl := &s.slots[i]
	if sl.state == slotWriting {
		delete(s.index, sl.key)
		sl.dead = true
		return false
	}
	s.removed(sl.key, false)
	return s.unindex(i, true)
}

// Clear removes every record, as Delete does for each, in the calling
// goroutine (one header write, or one punch, per record).
func (s *Store) Clear() {
	s.mu.Lock()
	if !s.begin() {
		s.mu.Unlock()
		return
	}
	defer s.inflight.Done()
	var now []int32
	for _, i := range s.index {
		if s.drop(i) {
			now = append(now, i)
		}
	}
	s.mu.Unlock()
	for _, i := range now {
		s.release(i)
	}
}

// Close waits for the operations in flight, flushes the files with
// FsyncOnClose, closes them and releases the directories' locks. Later
// calls return ErrClosed (Contains: false). Close is idempotent.
func (s *Store) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	s.inflight.Wait()
	var errs []error
	for _, d := range s.dirs {
		if s.cfg.Fsync == FsyncOnClose && d.writable {
			if err := unix.Fdatasync(d.fd); err != nil {
				errs = append(errs, opError("fdatasync", d.path, err))
			}
		}
	}
	s.mu.Lock()
	s.index = map[[16]byte]int32{}
	s.mu.Unlock()
	s.closeDirs()
	return errors.Join(errs...)
}
