package disk

import (
	"errors"
	"fmt"
)

// FsyncPolicy says when the store flushes written records to stable storage.
type FsyncPolicy uint8

const (
	// FsyncNone never flushes: a record survives a power loss only if the
	// device wrote it. A crash can leave torn records, which are misses.
	FsyncNone FsyncPolicy = iota
	// FsyncEach flushes (fdatasync) after each record's payload and again
	// after its header, before Put returns: a header that survives a crash
	// describes a payload that survived too. Two flushes a Put.
	FsyncEach
	// FsyncOnClose flushes every file once, in Close.
	FsyncOnClose
)

func (p FsyncPolicy) String() string {
	switch p {
	case FsyncNone:
		return "none"
	case FsyncEach:
		return "each"
	case FsyncOnClose:
		return "on-close"
	}
	return fmt.Sprintf("FsyncPolicy(%d)", uint8(p))
}

// DirectMode says whether the store uses O_DIRECT.
type DirectMode uint8

const (
	// DirectAuto uses O_DIRECT where the file system accepts it and
	// buffered I/O where it does not (tmpfs refuses O_DIRECT).
	DirectAuto DirectMode = iota
	// DirectRequire refuses to open a directory whose file system refuses
	// O_DIRECT.
	DirectRequire
	// DirectOff uses buffered I/O (the page cache) everywhere.
	DirectOff
)

func (m DirectMode) String() string {
	switch m {
	case DirectAuto:
		return "auto"
	case DirectRequire:
		return "require"
	case DirectOff:
		return "off"
	}
	return fmt.Sprintf("DirectMode(%d)", uint8(m))
}

// Config describes a store.
type Config struct {
	// Dirs are the directories records are kept in, one file each; the
	// capacity is split evenly between them. Each is locked for the store's
	// life.
	Dirs []string
	// CapacityBytes bounds the files' total size: it holds
	// CapacityBytes / SlotBytes records.
	CapacityBytes int64
	// RecordPayloadBytes is the payload size of every record (a host slot's
	// block), at most record.MaxPayloadBytes.
	RecordPayloadBytes int64
	// Fingerprint is record.Fingerprint of the writer's geometry: records
	// of another fingerprint are misses and their space is reused.
	Fingerprint uint64
	// Fsync is the flush policy (default FsyncNone).
	Fsync FsyncPolicy
	// Direct is the O_DIRECT policy (default DirectAuto).
	Direct DirectMode
	// ZeroOnRelease: a deleted or cleared record's slot is punched out of
	// the file (FALLOC_FL_PUNCH_HOLE; zeros written where the file system
	// cannot punch) instead of only its header being invalidated. An
	// evicted record's slot is overwritten by the record that evicts it,
	// or punched when that write fails.
	ZeroOnRelease bool
	// OnStore, when set, is called with the key of every record a Put
	// made readable. OnRemove, when set, is called with the key of every
	// readable record that leaves the index while the store is open:
	// evicted by a Put (evicted true), deleted, cleared, or dropped by a
	// Get that found it damaged or could not read it. Records found at
	// Open are not reported. Both run with the store's lock held (so a
	// key's calls come in the order the index changed): they must be quick,
	// never block, and never call into the store.
	OnStore  func(key [16]byte)
	OnRemove func(key [16]byte, evicted bool)

	// RemoveRecords names records files of other layouts (other slot
	// sizes: records-<slot bytes>.kvo, as kvoffload info --disk lists
	// them) to remove from every directory at Open, giving their space
	// back. By default Open leaves every other layout's records file
	// where it is: a directory may keep the records of several models,
	// each store using the one of its slot size; nothing this store did
	// not write is deleted unless named here. Naming this store's own
	// file, or a name that is not a records file's, is ErrConfig.
	RemoveRecords []string

	// Faults is for tests only (a fault-injection seam, also used by the
	// engine's tests): when set, it runs before each file operation of the
	// kind op on directory dir, and a non-nil error replaces the
	// operation's result (e.g. unix.ENOSPC for FaultWrite, unix.EIO for
	// FaultRead, unix.EROFS for FaultOpen: the directory is opened
	// read-only). Leave it nil in production.
	Faults func(op FaultOp, dir string) error

	// faults, set only by this package's tests, injects I/O errors.
	faults *faults
}

// FaultOp is the kind of file operation Config.Faults is asked about.
type FaultOp uint8

// FaultOp values.
const (
	FaultOpen       = FaultOp(opOpen)       // opening the records file for writing
	FaultOpenDirect = FaultOp(opOpenDirect) // opening it with O_DIRECT
	FaultWrite      = FaultOp(opWrite)      // a record's payload or header
	FaultRead       = FaultOp(opRead)       // a record's header and payload
	FaultFallocate  = FaultOp(opFallocate)  // preallocating the records file at Open (e.g. unix.ENOSPC)
)

// Errors. Every error of this package wraps one of these or an errno.
var (
	// ErrConfig: a Config field out of range (named in the message).
	ErrConfig = errors.New("disk: invalid config")
	// ErrLocked: a directory is held by another store (this process's or
	// another's); the message names the directory and its holder if known.
	ErrLocked = errors.New("disk: directory in use")
	// ErrDirectUnsupported: DirectRequire on a file system that refuses
	// O_DIRECT.
	ErrDirectUnsupported = errors.New("disk: O_DIRECT not supported")
	// ErrNoUsableDir: no directory could be opened for records.
	ErrNoUsableDir = errors.New("disk: no usable directory")
	// ErrClosed: the store was closed.
	ErrClosed = errors.New("disk: store closed")
	// ErrPayloadSize: a payload or destination of another size than
	// RecordPayloadBytes.
	ErrPayloadSize = errors.New("disk: wrong payload size")
	// ErrFull: Put found no slot: every slot is being written or read.
	ErrFull = errors.New("disk: no slot free")
	// ErrIO: Put's write failed (the errno is wrapped too); the record is
	// not stored.
	ErrIO = errors.New("disk: write failed")
)

// faults is the tests' fault seam: fn runs before each file operation and
// a non-nil error replaces the operation's result.
type faults struct {
	fn func(op faultOp, dir string) error
}

type faultOp uint8

const (
	opOpen       faultOp = iota // opening the records file for writing
	opOpenDirect                // opening it with O_DIRECT
	opWrite                     // a record's payload or header
	opRead                      // a record's header and payload
	opFallocate                 // preallocating the records file at Open
)

func (f *faults) inject(op faultOp, dir string) error {
	if f == nil || f.fn == nil {
		return nil
	}
	return f.fn(op, dir)
}
