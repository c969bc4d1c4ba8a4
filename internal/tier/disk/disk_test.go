package disk

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvoffload/kvoffload/internal/tier/record"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

const testFP = 0x5eed5eed5eed5eed

// fsKind is a directory maker with the I/O mode a store gets there.
type fsKind struct {
	dir  func(t *testing.T) string
	mode IOMode
	// faults makes the directory refuse O_DIRECT at open, as tmpfs did
	// before Linux 6.6.
	noDirect bool
}

// fsKinds returns the file systems the tests run on: "disk" (t.TempDir();
// skipped if it refuses O_DIRECT), "tmpfs" (/dev/shm; skipped if absent; it
// takes O_DIRECT from Linux 6.6 on), and "refuses-direct" (t.TempDir()
// with O_DIRECT refused by the fault seam with EINVAL).
func fsKinds() map[string]fsKind {
	mode := IOBuffered
	if probeDirect("/dev/shm") {
		mode = IODirect
	}
	return map[string]fsKind{
		"disk": {dir: func(t *testing.T) string { return directDir(t) }, mode: IODirect},
		"tmpfs": {dir: func(t *testing.T) string {
			var st unix.Statfs_t
			if err := unix.Statfs("/dev/shm", &st); err != nil || st.Type != unix.TMPFS_MAGIC {
				t.Skip("/dev/shm is not tmpfs")
			}
			dir, err := os.MkdirTemp("/dev/shm", "kvo-disk-test-")
			require.NoError(t, err)
			t.Cleanup(func() { os.RemoveAll(dir) })
			return dir
		}, mode: mode},
		"refuses-direct": {dir: func(t *testing.T) string { return directDir(t) }, mode: IOBuffered, noDirect: true},
	}
}

// config returns a one-directory Config on kind k.
func (k fsKind) config(t *testing.T, payloadBytes, records int64) Config {
	cfg := config(k.dir(t), payloadBytes, records)
	if k.noDirect {
		cfg.faults = refuseDirect()
	}
	return cfg
}

func refuseDirect() *faults {
	return errOn(opOpenDirect, unix.EINVAL, func() bool { return true })
}

func probeDirect(dir string) bool {
	f, err := os.CreateTemp(dir, "probe")
	if err != nil {
		return false
	}
	defer os.Remove(f.Name())
	f.Close()
	fd, err := unix.Open(f.Name(), unix.O_RDWR|unix.O_DIRECT, 0)
	if err != nil {
		return false
	}
	unix.Close(fd)
	return true
}

func directDir(t testing.TB) string {
	dir := t.TempDir()
	if !probeDirect(dir) {
		t.Skipf("%s refuses O_DIRECT", dir)
	}
	return dir
}

func key(i int) [16]byte {
	var k [16]byte
	binary.LittleEndian.PutUint64(k[:], uint64(i)+1)
	binary.LittleEndian.PutUint64(k[8:], 0x9e3779b97f4a7c15*uint64(i+1))
	return k
}

// payload returns n bytes determined by k, in an aligned buffer.
func payload(k [16]byte, n int64) []byte {
	b := alignedBuf(int(roundUp(n, align)))[:n]
	r := rand.NewChaCha8([32]byte(append(k[:], k[:]...)))
	_, _ = r.Read(b)
	return b
}

func config(dir string, payloadBytes int64, records int64) Config {
	return Config{
		Dirs:               []string{dir},
		CapacityBytes:      records * SlotBytes(payloadBytes),
		RecordPayloadBytes: payloadBytes,
		Fingerprint:        testFP,
	}
}

func open(t *testing.T, cfg Config) *Store {
	t.Helper()
	s, err := Open(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s
}

// mustGet reads k and requires it to be exactly its payload.
func mustGet(t *testing.T, s *Store, k [16]byte) {
	t.Helper()
	dst := alignedBuf(int(s.padded))[:s.cfg.RecordPayloadBytes]
	ok, err := s.Get(k, dst)
	require.NoError(t, err)
	require.True(t, ok, "key %x", k)
	require.Equal(t, payload(k, s.cfg.RecordPayloadBytes), dst)
}

func mustMiss(t *testing.T, s *Store, k [16]byte) {
	t.Helper()
	ok, err := s.Get(k, make([]byte, s.cfg.RecordPayloadBytes))
	require.NoError(t, err)
	require.False(t, ok, "key %x", k)
}

func TestRoundTrip(t *testing.T) {
	for name, kind := range fsKinds() {
		for _, size := range []int64{3 * align, 10000} {
			t.Run(fmt.Sprintf("%s/%d", name, size), func(t *testing.T) {
				cfg := kind.config(t, size, 8)
				if size%align != 0 {
					cfg.Fsync = FsyncEach // the payload, a flush, the header, a flush
				}
				s := open(t, cfg)
				st := s.Stats()
				require.Equal(t, kind.mode, st.Mode)
				for i := range 4 {
					k := key(i)
					p := payload(k, size)
					if i%2 == 1 { // an unaligned buffer goes through a bounce buffer
						u := make([]byte, size+1)[1:]
						copy(u, p)
						p = u
					}
					require.NoError(t, s.Put(k, p))
					require.True(t, s.Contains(k))
				}
				for i := range 4 {
					mustGet(t, s, key(i))
					u := make([]byte, size+7)[3:] // unaligned and longer
					ok, err := s.Get(key(i), u)
					require.NoError(t, err)
					require.True(t, ok)
					require.Equal(t, payload(key(i), size), u[:size])
				}
				mustMiss(t, s, key(99))
				require.False(t, s.Contains(key(99)))
				require.NoError(t, s.Put(key(0), payload(key(0), size)), "a key stored again is kept")
				st = s.Stats()
				require.Equal(t, int64(4), st.Records)
				require.Equal(t, 4*size, st.Bytes)
				require.Equal(t, int64(8), st.Hits)
				require.Equal(t, int64(1), st.Misses)

				_, err := s.Get(key(0), make([]byte, size-1))
				require.ErrorIs(t, err, ErrPayloadSize)
				require.ErrorIs(t, s.Put(key(50), make([]byte, size+1)), ErrPayloadSize)

				var fst unix.Stat_t
				require.NoError(t, unix.Stat(s.dirs[0].path, &fst))
				require.Equal(t, uint32(0o600), fst.Mode&0o777)
				require.Equal(t, 8*SlotBytes(size), fst.Size)
			})
		}
	}
}

func TestDirectRequire(t *testing.T) {
	cfg := fsKinds()["refuses-direct"].config(t, align, 4)
	cfg.Direct = DirectRequire
	_, err := Open(cfg)
	require.ErrorIs(t, err, ErrDirectUnsupported)
	require.ErrorContains(t, err, cfg.Dirs[0])
	cfg.Direct = DirectAuto
	s := open(t, cfg)
	require.Equal(t, IOBuffered, s.Stats().Mode)
	require.NoError(t, s.Close())

	cfg = config(directDir(t), align, 4)
	cfg.Direct = DirectOff
	s = open(t, cfg)
	require.Equal(t, IOBuffered, s.Stats().Mode)
}

func TestMixedDirs(t *testing.T) {
	noDirect := t.TempDir()
	cfg := config(directDir(t), align, 6)
	cfg.Dirs = append(cfg.Dirs, noDirect)
	cfg.faults = &faults{fn: func(op faultOp, dir string) error {
		if op == opOpenDirect && dir == noDirect {
			return unix.EINVAL
		}
		return nil
	}}
	s := open(t, cfg)
	st := s.Stats()
	require.Equal(t, IOMixed, st.Mode)
	require.Equal(t, 2, st.Dirs)
	require.Equal(t, 1, st.DirectDirs)
	require.Equal(t, int64(6), st.CapacityRecords)
	for i := range 6 {
		require.NoError(t, s.Put(key(i), payload(key(i), align)))
	}
	for i := range 6 {
		mustGet(t, s, key(i))
		// Puts fill each file from its start, the directories in turn.
		require.Equal(t, int64(i/2)*s.slotBytes+int64(i%2)*3*s.slotBytes, slotOff(t, s, key(i)))
	}
	require.Zero(t, s.Stats().Evictions)
}

func TestRestart(t *testing.T) {
	for name, kind := range fsKinds() {
		t.Run(name, func(t *testing.T) {
			cfg := kind.config(t, 2*align, 16)
			cfg.Fsync = FsyncOnClose
			s := open(t, cfg)
			for i := range 10 {
				require.NoError(t, s.Put(key(i), payload(key(i), cfg.RecordPayloadBytes)))
			}
			s.Delete(key(3))
			require.NoError(t, s.Close())
			require.NoError(t, s.Close(), "Close is idempotent")
			_, err := s.Get(key(0), make([]byte, cfg.RecordPayloadBytes))
			require.ErrorIs(t, err, ErrClosed)
			require.ErrorIs(t, s.Put(key(20), payload(key(20), cfg.RecordPayloadBytes)), ErrClosed)
			require.False(t, s.Contains(key(0)))

			s = open(t, cfg)
			st := s.Stats()
			require.Equal(t, int64(9), st.Records)
			require.Zero(t, st.TornAtOpen)
			require.Zero(t, st.StaleAtOpen)
			for i := range 10 {
				if i == 3 {
					require.False(t, s.Contains(key(i)), "a deleted record does not come back")
					continue
				}
				require.True(t, s.Contains(key(i)))
				mustGet(t, s, key(i))
			}
			// The free slots are the ones left: 7 more fit without eviction.
			for i := 10; i < 17; i++ {
				require.NoError(t, s.Put(key(i), payload(key(i), cfg.RecordPayloadBytes)))
			}
			require.Zero(t, s.Stats().Evictions)
			require.NoError(t, s.Close())

			// Another fingerprint: every record is stale, a miss, its space reused.
			cfg.Fingerprint++
			s = open(t, cfg)
			st = s.Stats()
			require.Zero(t, st.Records)
			require.Equal(t, int64(16), st.StaleAtOpen)
			mustMiss(t, s, key(0))
			require.NoError(t, s.Put(key(0), payload(key(0), cfg.RecordPayloadBytes)))
			require.NoError(t, s.Close())

			// Another record size: another file, the first kept beside it.
			cfg.RecordPayloadBytes = 3 * align
			s = open(t, cfg)
			require.Zero(t, s.Stats().Records)
			files, _ := filepath.Glob(filepath.Join(cfg.Dirs[0], "records-*.kvo"))
			require.Len(t, files, 2, "both layouts' files (layouts_test.go reads their records)")
			require.Contains(t, files, s.dirs[0].path)
		})
	}
}

// slotOff returns the file offset of key's slot.
func slotOff(t *testing.T, s *Store, k [16]byte) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	i, ok := s.index[k]
	require.True(t, ok)
	return int64(i) * s.slotBytes
}

// patch writes b at off of the records file, around the store.
func patch(t *testing.T, path string, off int64, b []byte) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	require.NoError(t, err)
	_, err = f.WriteAt(b, off)
	require.NoError(t, err)
	require.NoError(t, f.Close())
}

func readAt(t *testing.T, path string, off int64, n int) []byte {
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	b := make([]byte, n)
	_, err = f.ReadAt(b, off)
	require.NoError(t, err)
	return b
}

// scanModes runs f with the start-up scan reading one header a slot and
// reading runs of whole slots, whatever the slot size.
func scanModes(t *testing.T, f func(t *testing.T)) {
	saved := scanWholeMax
	t.Cleanup(func() { scanWholeMax = saved })
	for _, m := range []struct {
		name string
		max  int64
	}{{"headers", 0}, {"whole", 1 << 40}} {
		scanWholeMax = m.max
		t.Run(m.name, f)
	}
}

func TestTornRecords(t *testing.T) { scanModes(t, testTornRecords) }

func testTornRecords(t *testing.T) {
	for name, kind := range fsKinds() {
		t.Run(name, func(t *testing.T) {
			const size = 4 * align
			cfg := kind.config(t, size, 8)
			s := open(t, cfg)
			for i := range 8 {
				require.NoError(t, s.Put(key(i), payload(key(i), size)))
			}
			path := s.dirs[0].path
			// Roles by slot, from the end of the file: cut, flipped payload,
			// flipped header byte, stale header checksum, previous header
			// over a new payload, then three intact records.
			ks := make([][16]byte, 8)
			for i := range 8 {
				ks[7-slotOff(t, s, key(i))/s.slotBytes] = key(i)
			}
			cut, flipped, badHeader, staleSum, crashed, intact := ks[0], ks[1], ks[2], ks[3], ks[4], ks[5:]
			off := func(k [16]byte) int64 { return slotOff(t, s, k) }
			offCut, offBad, offStale, offCrashed := off(cut), off(badHeader), off(staleSum), off(crashed)

			// A flipped payload byte is found by the first Get: a miss, counted, dropped.
			patch(t, path, off(flipped)+record.HeaderSize+1234, []byte{^payload(flipped, size)[1234]})
			mustMiss(t, s, flipped)
			st := s.Stats()
			require.Equal(t, int64(1), st.Corrupt)
			require.Equal(t, int64(1), st.Misses)
			require.False(t, s.Contains(flipped))
			mustMiss(t, s, flipped)
			require.Equal(t, int64(1), s.Stats().Corrupt, "counted once: the record was dropped")
			require.NoError(t, s.Close())

			// At rest: a header byte flipped; a header rewritten with a stale
			// checksum; a new payload under the slot's previous header (a crash
			// between the two writes of a Put); the file cut inside the last
			// record's payload.
			patch(t, path, offBad+30, []byte{readAt(t, path, offBad+30, 1)[0] ^ 0x08})
			old := readAt(t, path, offStale, record.HeaderLen)
			binary.LittleEndian.PutUint16(old[8:], record.FormatVersion-1)
			patch(t, path, offStale, old[:record.HeaderLen-8])
			patch(t, path, offCrashed+record.HeaderSize, payload(key(42), size))
			require.NoError(t, os.Truncate(path, offCut+record.HeaderSize+size/2))

			s = open(t, cfg)
			st = s.Stats()
			require.Equal(t, int64(3), st.TornAtOpen, "flipped header, stale checksum, cut payload")
			for _, k := range [][16]byte{cut, flipped, badHeader, staleSum} {
				require.False(t, s.Contains(k))
				mustMiss(t, s, k)
			}
			require.True(t, s.Contains(crashed), "its header is intact: only its payload is wrong")
			mustMiss(t, s, crashed)
			require.Equal(t, int64(1), s.Stats().Corrupt)
			for _, k := range intact {
				mustGet(t, s, k)
			}
			// The five slots are reused.
			for i := 100; i < 105; i++ {
				require.NoError(t, s.Put(key(i), payload(key(i), size)))
			}
			require.Zero(t, s.Stats().Evictions)
		})
	}
}

func TestOlderFormatVersionIsStale(t *testing.T) {
	cfg := config(directDir(t), align, 2)
	s := open(t, cfg)
	require.NoError(t, s.Put(key(0), payload(key(0), align)))
	off := slotOff(t, s, key(0))
	require.NoError(t, s.Close())
	hdr := readAt(t, s.dirs[0].path, off, record.HeaderLen)
	binary.LittleEndian.PutUint16(hdr[8:], record.FormatVersion+1)
	binary.LittleEndian.PutUint32(hdr[56:], record.Checksum(hdr[:56]))
	patch(t, s.dirs[0].path, off, hdr)
	s = open(t, cfg)
	require.Equal(t, int64(1), s.Stats().StaleAtOpen)
	require.False(t, s.Contains(key(0)))
}

func TestDirectoryLock(t *testing.T) {
	dir := directDir(t)
	cfg := config(dir, align, 4)
	s := open(t, cfg)
	_, err := Open(cfg)
	require.ErrorIs(t, err, ErrLocked)
	require.ErrorContains(t, err, dir)
	require.ErrorContains(t, err, fmt.Sprintf("pid %d", os.Getpid()))

	other := cfg
	other.Dirs = []string{directDir(t), dir}
	_, err = Open(other)
	require.ErrorIs(t, err, ErrLocked, "one locked directory refuses the whole store")

	twice := cfg
	twice.Dirs = []string{dir, dir + "/."}
	_, err = Open(twice)
	require.ErrorIs(t, err, ErrConfig)

	require.NoError(t, s.Close())
	s = open(t, cfg)
	require.NoError(t, s.Close())
}

func TestConfigErrors(t *testing.T) {
	dir := t.TempDir()
	for name, cfg := range map[string]Config{
		"no dirs":       {CapacityBytes: 1 << 20, RecordPayloadBytes: align},
		"no payload":    {Dirs: []string{dir}, CapacityBytes: 1 << 20},
		"huge payload":  {Dirs: []string{dir}, CapacityBytes: 1 << 40, RecordPayloadBytes: record.MaxPayloadBytes + 1},
		"capacity":      {Dirs: []string{dir}, CapacityBytes: SlotBytes(align) - 1, RecordPayloadBytes: align},
		"bad fsync":     {Dirs: []string{dir}, CapacityBytes: 1 << 20, RecordPayloadBytes: align, Fsync: 9},
		"bad direct":    {Dirs: []string{dir}, CapacityBytes: 1 << 20, RecordPayloadBytes: align, Direct: 9},
		"cap under dir": {Dirs: []string{dir, t.TempDir()}, CapacityBytes: SlotBytes(align), RecordPayloadBytes: align},
	} {
		_, err := Open(cfg)
		require.ErrorIs(t, err, ErrConfig, name)
	}
	_, err := Open(config(filepath.Join(dir, "missing"), align, 2))
	require.ErrorIs(t, err, ErrNoUsableDir)
}

func TestEvictionLRU(t *testing.T) {
	cfg := config(directDir(t), align, 4)
	s := open(t, cfg)
	for i := range 4 {
		require.NoError(t, s.Put(key(i), payload(key(i), align)))
	}
	mustGet(t, s, key(0)) // 0 becomes the most recent: 1 is the oldest
	for i := 4; i < 6; i++ {
		require.NoError(t, s.Put(key(i), payload(key(i), align)))
	}
	st := s.Stats()
	require.Equal(t, int64(2), st.Evictions)
	require.Equal(t, int64(4), st.Records)
	for _, i := range []int{0, 3, 4, 5} {
		mustGet(t, s, key(i))
	}
	for _, i := range []int{1, 2} {
		require.False(t, s.Contains(key(i)))
	}
	require.NoError(t, s.Close())
	s = open(t, cfg)
	require.Equal(t, int64(4), s.Stats().Records, "the evicted records were overwritten")
	mustGet(t, s, key(5))
}

func TestDeleteClearZeroOnRelease(t *testing.T) {
	for _, zero := range []bool{false, true} {
		t.Run(fmt.Sprint("zero=", zero), func(t *testing.T) {
			const size = 16 * align
			cfg := config(directDir(t), size, 8)
			cfg.ZeroOnRelease = zero
			s := open(t, cfg)
			for i := range 8 {
				require.NoError(t, s.Put(key(i), payload(key(i), size)))
			}
			off := slotOff(t, s, key(0))
			s.Delete(key(0))
			s.Delete(key(77)) // absent: nothing happens
			require.False(t, s.Contains(key(0)))
			mustMiss(t, s, key(0))
			got := readAt(t, s.dirs[0].path, off, int(s.slotBytes))
			require.Equal(t, make([]byte, record.HeaderSize), got[:record.HeaderSize], "header invalidated")
			if zero {
				require.Equal(t, make([]byte, size), got[record.HeaderSize:], "payload punched out")
			} else {
				require.Equal(t, payload(key(0), size), got[record.HeaderSize:])
			}
			s.Clear()
			require.Zero(t, s.Stats().Records)
			require.NoError(t, s.Close())
			s = open(t, cfg)
			st := s.Stats()
			require.Zero(t, st.Records)
			require.Zero(t, st.TornAtOpen)
			for i := range 8 {
				require.NoError(t, s.Put(key(i), payload(key(i), size)))
			}
			require.Zero(t, s.Stats().Evictions)
		})
	}
}

// errOn injects err into every op of kind in dir while on() is true.
func errOn(kind faultOp, err error, on func() bool) *faults {
	return &faults{fn: func(op faultOp, _ string) error {
		if op == kind && on() {
			return err
		}
		return nil
	}}
}

func TestFaults(t *testing.T) {
	for name, errno := range map[string]unix.Errno{"ENOSPC": unix.ENOSPC, "EIO": unix.EIO, "EROFS": unix.EROFS} {
		t.Run(name, func(t *testing.T) {
			var mu sync.Mutex
			failWrites, failReads := false, false
			flag := func(b *bool) func() bool { return func() bool { mu.Lock(); defer mu.Unlock(); return *b } }
			set := func(b *bool, v bool) { mu.Lock(); *b = v; mu.Unlock() }
			cfg := config(directDir(t), align, 4)
			cfg.faults = &faults{fn: func(op faultOp, dir string) error {
				if (op == opWrite && flag(&failWrites)()) || (op == opRead && flag(&failReads)()) {
					return errno
				}
				return nil
			}}
			s := open(t, cfg)
			require.NoError(t, s.Put(key(0), payload(key(0), align)))
			set(&failWrites, true)
			err := s.Put(key(1), payload(key(1), align))
			require.ErrorIs(t, err, ErrIO)
			require.ErrorIs(t, err, errno)
			require.False(t, s.Contains(key(1)))
			st := s.Stats()
			require.Equal(t, int64(1), st.IOErrors)
			if errno == unix.ENOSPC {
				require.Equal(t, int64(1), st.NoSpace)
			} else {
				require.Zero(t, st.NoSpace)
			}
			set(&failWrites, false)
			require.NoError(t, s.Put(key(1), payload(key(1), align)), "usable after the fault")
			mustGet(t, s, key(1))

			set(&failReads, true)
			mustMiss(t, s, key(0))
			st = s.Stats()
			require.Equal(t, int64(2), st.IOErrors)
			require.Zero(t, st.Corrupt)
			require.False(t, s.Contains(key(0)), "a record that failed to read is dropped")
			set(&failReads, false)
			mustGet(t, s, key(1))
			require.Equal(t, int64(3), s.Stats().Records+int64(len(s.free))-1, "every slot is accounted for")
		})
	}
}

func TestReadOnlyDir(t *testing.T) {
	dir := directDir(t)
	cfg := config(dir, align, 4)
	s := open(t, cfg)
	for i := range 2 {
		require.NoError(t, s.Put(key(i), payload(key(i), align)))
	}
	require.NoError(t, s.Close())

	// As a read-only mount answers: EROFS when the file is opened for writing.
	ro := cfg
	ro.faults = errOn(opOpen, unix.EROFS, func() bool { return true })
	s = open(t, ro)
	st := s.Stats()
	require.Equal(t, 1, st.ReadOnlyDirs)
	require.Equal(t, int64(2), st.Records)
	mustGet(t, s, key(0))
	require.ErrorIs(t, s.Put(key(5), payload(key(5), align)), ErrFull, "no slot takes new records")
	require.Equal(t, int64(1), s.Stats().Dropped)
	s.Delete(key(1)) // forgotten, not invalidated
	require.False(t, s.Contains(key(1)))
	require.NoError(t, s.Close())

	s = open(t, cfg)
	require.True(t, s.Contains(key(1)), "the read-only store wrote nothing")
	require.NoError(t, s.Close())

	// A read-only directory with no records file is unusable; with another
	// directory the store opens without it.
	empty := ro
	empty.Dirs = []string{directDir(t)}
	_, err := Open(empty)
	require.ErrorIs(t, err, ErrNoUsableDir)

	if os.Geteuid() != 0 { // root writes through mode bits
		d := t.TempDir()
		require.NoError(t, os.Chmod(d, 0o500))
		t.Cleanup(func() { os.Chmod(d, 0o700) })
		two := config(directDir(t), align, 4)
		two.Dirs = append(two.Dirs, d)
		s = open(t, two)
		require.Equal(t, 1, s.Stats().UnusableDirs)
		require.Equal(t, int64(2), s.Stats().CapacityRecords)
	}
}

func TestConcurrent(t *testing.T) {
	for name, kind := range fsKinds() {
		t.Run(name, func(t *testing.T) {
			const size = 2 * align
			cfg := kind.config(t, size, 24)
			s := open(t, cfg)
			var wg sync.WaitGroup
			for g := range 16 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					r := rand.New(rand.NewPCG(uint64(g), 1))
					dst := alignedBuf(size)
					for range 300 {
						k := key(r.IntN(40))
						switch op := r.IntN(10); {
						case op < 4:
							if err := s.Put(k, payload(k, size)); err != nil && !errors.Is(err, ErrFull) {
								t.Error(err)
								return
							}
						case op < 8:
							ok, err := s.Get(k, dst)
							if err != nil {
								t.Error(err)
								return
							}
							if ok && string(dst) != string(payload(k, size)) {
								t.Errorf("key %x: wrong bytes", k)
								return
							}
						case op == 8:
							s.Contains(k)
						default:
							s.Delete(k)
						}
					}
					if g == 0 {
						s.Clear()
					}
				}()
			}
			wg.Wait()
			st := s.Stats()
			require.Zero(t, st.Corrupt)
			require.Zero(t, st.IOErrors)
			s.mu.Lock()
			require.Equal(t, int64(len(s.index)), st.Records)
			require.Equal(t, len(s.slots), len(s.index)+len(s.free), "every slot is indexed or free")
			s.mu.Unlock()
		})
	}
}

// TestHooks: OnStore reports each record a Put made readable, OnRemove each
// one that left the index (evicted, deleted, dropped by a failed read,
// cleared); the exported Faults seam injects as the internal one does.
func TestHooks(t *testing.T) {
	type ev struct {
		key     [16]byte
		stored  bool
		evicted bool
	}
	var mu sync.Mutex
	var evs []ev
	failReads := false
	cfg := config(directDir(t), align, 2)
	cfg.OnStore = func(k [16]byte) { mu.Lock(); evs = append(evs, ev{key: k, stored: true}); mu.Unlock() }
	cfg.OnRemove = func(k [16]byte, evicted bool) {
		mu.Lock()
		evs = append(evs, ev{key: k, evicted: evicted})
		mu.Unlock()
	}
	cfg.Faults = func(op FaultOp, _ string) error {
		mu.Lock()
		defer mu.Unlock()
		if op == FaultRead && failReads {
			return unix.EIO
		}
		return nil
	}
	s := open(t, cfg)
	for i := range 3 { // the third evicts key 0
		require.NoError(t, s.Put(key(i), payload(key(i), align)))
	}
	require.NoError(t, s.Put(key(2), payload(key(2), align)), "already stored: no event")
	s.Delete(key(1))
	s.Delete(key(1))
	require.NoError(t, s.Put(key(3), payload(key(3), align)))
	mu.Lock()
	failReads = true
	mu.Unlock()
	mustMiss(t, s, key(3))
	require.NoError(t, s.Put(key(4), payload(key(4), align)))
	s.Clear()
	want := []ev{{key: key(0), stored: true}, {key: key(1), stored: true}, {key: key(0), evicted: true},
		{key: key(2), stored: true}, {key: key(1)}, {key: key(3), stored: true}, {key: key(3)},
		{key: key(4), stored: true}}
	mu.Lock()
	got := evs
	mu.Unlock()
	require.Equal(t, want, got[:len(want)])
	require.ElementsMatch(t, []ev{{key: key(2)}, {key: key(4)}}, got[len(want):], "Clear reports every record")
	require.Equal(t, int64(1), s.Stats().IOErrors)
}

// TestInspect: Inspect reports a store's files, records by fingerprint,
// mode and holder, and changes nothing.
func TestInspect(t *testing.T) {
	dir := t.TempDir()
	info := Inspect(dir)
	require.Empty(t, info.Error)
	require.Empty(t, info.Files)
	require.True(t, info.Writable)
	require.Contains(t, []string{"direct", "buffered"}, info.Mode)
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Empty(t, entries, "the probe file is removed")

	cfg := config(dir, align, 4)
	s := open(t, cfg)
	for i := range 3 {
		require.NoError(t, s.Put(key(i), payload(key(i), align)))
	}
	info = Inspect(dir)
	require.Contains(t, info.Holder, fmt.Sprintf("pid %d", os.Getpid()), "the store holds the directory")
	require.NoError(t, s.Close())

	info = Inspect(dir)
	require.Empty(t, info.Error)
	require.Empty(t, info.Holder)
	require.Len(t, info.Files, 1)
	f := info.Files[0]
	require.Equal(t, SlotBytes(align), f.SlotBytes)
	require.Equal(t, int64(4), f.CapacityRecords)
	require.Equal(t, map[string]int64{fmt.Sprintf("%016x", cfg.Fingerprint): 3}, f.Records)
	require.Zero(t, f.Damaged)
	require.Equal(t, map[bool]string{true: "direct", false: "buffered"}[s.Stats().Mode == IODirect], info.Mode)

	info = Inspect(filepath.Join(dir, "absent"))
	require.NotEmpty(t, info.Error)
}

// TestZeroOnReleaseFailedPut: with ZeroOnRelease, a Put whose write fails
// after evicting a record leaves none of that record's bytes in the file.
func TestZeroOnReleaseFailedPut(t *testing.T) {
	const size = 4 * align
	var fail atomic.Bool
	cfg := config(t.TempDir(), size, 2)
	cfg.ZeroOnRelease = true
	cfg.Faults = func(op FaultOp, _ string) error {
		if op == FaultWrite && fail.Load() {
			return unix.EIO
		}
		return nil
	}
	s := open(t, cfg)
	require.NoError(t, s.Put(key(0), payload(key(0), size)))
	require.NoError(t, s.Put(key(1), payload(key(1), size)))
	fail.Store(true)
	require.ErrorIs(t, s.Put(key(2), payload(key(2), size)), ErrIO)
	require.False(t, s.Contains(key(0)), "evicted")
	b, err := os.ReadFile(s.dirs[0].path)
	require.NoError(t, err)
	require.False(t, bytes.Contains(b, payload(key(0), size)), "the evicted record's bytes are gone")
	require.True(t, bytes.Contains(b, payload(key(1), size)))
	fail.Store(false)
	require.NoError(t, s.Put(key(2), payload(key(2), size)), "the slot is usable again")
	mustGet(t, s, key(2))
}

// TestScanChunks: a file of more slots than the scan's workers read in
// one chunk each (so chunks follow one another in each worker's run), with
// empty, stale, torn and valid slots and the file cut short, is indexed the
// same reading one header a slot and reading runs of whole slots.
func TestScanChunks(t *testing.T) {
	const n = scanWorkers*(scanChunk/(record.HeaderSize+align)) + 700
	cfg := config(directDir(t), align, n)
	s := open(t, cfg)
	payloads := make([][]byte, 16)
	for g := range payloads {
		payloads[g] = alignedBuf(align)
	}
	require.NoError(t, forEach(len(payloads), n, func(g int, k [16]byte) error {
		copy(payloads[g], k[:])
		return s.Put(k, payloads[g])
	}))
	path := s.dirs[0].path
	keys := make(map[[16]byte]int64)
	s.mu.Lock()
	for k, i := range s.index {
		keys[k] = int64(i)
	}
	s.mu.Unlock()
	require.NoError(t, s.Close())
	// Damage some headers (torn), make some stale, cut the file inside the
	// last slot's payload.
	var i int64
	for _, slot := range keys {
		off := slot * s.slotBytes
		switch i++; i % 97 {
		case 1:
			patch(t, path, off+30, []byte{readAt(t, path, off+30, 1)[0] ^ 0x10})
		case 2:
			hdr := readAt(t, path, off, record.HeaderLen)
			binary.LittleEndian.PutUint16(hdr[8:], record.FormatVersion+1)
			binary.LittleEndian.PutUint32(hdr[56:], record.Checksum(hdr[:56]))
			patch(t, path, off, hdr)
		}
	}
	fi, err := os.Stat(path)
	require.NoError(t, err)
	cut := fi.Size() - s.slotBytes - align/2 // inside the second last slot's payload, not on a sector

	type seen struct {
		st   Stats
		keys map[[16]byte]bool
	}
	var got []seen
	scanModes(t, func(t *testing.T) {
		require.NoError(t, os.Truncate(path, cut)) // again: Open extends the file back
		s := open(t, cfg)
		defer s.Close()
		sn := seen{st: s.Stats(), keys: map[[16]byte]bool{}}
		for k := range keys {
			if s.Contains(k) {
				sn.keys[k] = true
			}
		}
		require.Positive(t, sn.st.TornAtOpen)
		require.Positive(t, sn.st.StaleAtOpen)
		require.Greater(t, sn.st.Records, int64(n-200))
		got = append(got, sn)
	})
	require.Len(t, got, 2)
	require.Equal(t, got[0].st.Records, got[1].st.Records)
	require.Equal(t, got[0].st.TornAtOpen, got[1].st.TornAtOpen)
	require.Equal(t, got[0].st.StaleAtOpen, got[1].st.StaleAtOpen)
	require.Equal(t, got[0].keys, got[1].keys)
}

// A record of at least splitMinBytes read with O_DIRECT is read in two
// reads (the header sector and the head, then the tail while the head's CRC
// runs): for a payload that is a multiple of 4 KiB (read into dst) and one
// that is not (read through a bounce buffer), every record reads back
// whole; a byte flipped in the tail, in the head or in the header is a
// miss counted Corrupt, and a tail the file cuts short is a miss counted
// IOErrors, each record dropped; through a bounce buffer, dst is left as it
// was on each miss.
func TestSplitRead(t *testing.T) {
	for _, size := range []int64{1 << 20, 1<<20 + 100} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			const records = 5
			s := open(t, config(directDir(t), size, records))
			tail := s.readTail(s.dirs[0])
			require.Positive(t, tail, "the read is split")
			head := int64(s.padded) - int64(tail) // payload bytes in the first read
			require.Less(t, head, size, "the tail holds payload bytes")
			for i := range records {
				require.NoError(t, s.Put(key(i), payload(key(i), size)))
			}
			for i := range records {
				mustGet(t, s, key(i))
				dst := make([]byte, size+1) // unaligned length: the bounce buffer
				ok, err := s.Get(key(i), dst[1:])
				require.NoError(t, err)
				require.True(t, ok)
				require.Equal(t, payload(key(i), size), dst[1:])
			}

			// The record at the end of the file is cut inside its tail;
			// three others get a byte flipped in the tail, the head, the
			// header; the last stays intact.
			var byOff [records][16]byte
			for i := range records {
				byOff[slotOff(t, s, key(i))/s.slotBytes] = key(i)
			}
			cut, inTail, inHead, inHeader, intact := byOff[records-1], byOff[0], byOff[1], byOff[2], byOff[3]
			path := s.dirs[0].path
			flip := func(k [16]byte, at int64) {
				off := slotOff(t, s, k) + at
				patch(t, path, off, []byte{readAt(t, path, off, 1)[0] ^ 0x40})
			}
			flip(inTail, record.HeaderSize+size-1)
			flip(inHead, record.HeaderSize+head-1)
			flip(inHeader, 40) // the payload length
			require.NoError(t, os.Truncate(path, slotOff(t, s, cut)+record.HeaderSize+head+align))

			for n, k := range [][16]byte{inTail, inHead, inHeader} {
				dst := bytes.Repeat([]byte{0xee}, int(size)+1)
				ok, err := s.Get(k, dst[1:])
				require.NoError(t, err)
				require.False(t, ok, "key %x", k)
				require.Equal(t, bytes.Repeat([]byte{0xee}, int(size)+1), dst, "dst untouched by a miss")
				require.Equal(t, int64(n+1), s.Stats().Corrupt)
				require.False(t, s.Contains(k), "dropped")
			}
			mustMiss(t, s, cut)
			st := s.Stats()
			require.Equal(t, int64(1), st.IOErrors, "the cut tail")
			require.Equal(t, int64(3), st.Corrupt)
			require.False(t, s.Contains(cut), "dropped")
			mustGet(t, s, intact)
			require.Equal(t, int64(2*records+1), s.Stats().Hits)
		})
	}
}
