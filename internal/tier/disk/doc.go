// Package disk is the disk tier: a store of fixed-size records (package
// record's format) in preallocated files, one per directory, keyed by the
// blocks' 16-byte keys. It knows nothing of CUDA or of the engine, which
// demotes host blocks into it and promotes them back into pinned slots.
//
// # Files
//
// Each directory of Config.Dirs holds one records file,
// records-<slot bytes>.kvo (mode 0600), preallocated with fallocate to its
// share of CapacityBytes and cut into slots of SlotBytes: a 4 KiB header
// sector then the payload rounded up to 4 KiB, so every read and write is
// aligned for O_DIRECT. Each directory is locked with flock(2) for the
// store's life (a second Open of it, from this process or another, is
// ErrLocked naming the holder written in kvoffload.holder).
//
// A directory may hold the records files of several layouts (several slot
// sizes: the blocks of several models), one a layout. Open uses the file
// of its own slot size and leaves every other one as it is: records this
// store did not write for its layout are never deleted, so each model's
// engine finds its own blocks again whichever opened the directory last.
// Only Config.RemoveRecords, which names the other layouts' files one by
// one (records-<slot bytes>.kvo, as Inspect lists them), removes them, to
// give their space back; naming the store's own file is ErrConfig. The
// kept files take their space: when the store's own file cannot be
// preallocated (ENOSPC), Open's error names the other layouts' files and
// their sizes. Records of another fingerprint in the store's own file
// (another model of the same slot size, or the same model under another
// namespace) are another matter: they are misses, and their slots are
// reused as new records need them. Models of one slot size that must
// keep each other's blocks need directories of their own.
//
// The files inside a directory, the records file and kvoffload.holder, are
// opened relative to the locked directory and never through a symbolic
// link (O_NOFOLLOW): a link planted under either name, a FIFO, or a
// regular file that has another hard link is ErrUnsafeFile naming it, and
// the directory is not used (unusable, as one that cannot be opened), so
// no write, truncation or preallocation ever reaches a file outside it.
// The directory itself may be a symbolic link: where the records live is
// the operator's choice. Inspect reads no file through a link either.
//
// # What it guarantees
//
//   - Get never returns bytes that fail a check: the header checksum, the
//     format and host-layout versions, the fingerprint, the key, the length
//     and the payload's CRC-32C are verified before it returns true. A
//     failure is a miss, counted (Stats.Corrupt), and the record is dropped.
//   - A Put writes its record inside its own slot: header and payload in one
//     pwritev, or with FsyncEach the payload, a flush, the header (which
//     carries the payload checksum), a flush. No write touches another
//     slot. A crash can leave a slot whose header and payload do not match
//     (its previous header over a new payload, or a new header over a partly
//     written one): the payload checksum fails at the first Get, which
//     drops it. A damaged header is discarded at Open (Stats.TornAtOpen).
//     With FsyncEach, a header on stable storage implies its payload is.
//   - Open rebuilds the index from the headers alone (payloads are verified
//     when read), 32 reads in flight per directory and every directory at
//     once. Records of at most 16 KiB (header included) are read in runs of
//     whole slots, up to 1 MiB a read, payloads and all (one read instead of
//     up to 256); larger ones one header sector a record.
//   - Faults are misses and counters, never errors on the serving path: an
//     I/O error in Get is (false, nil) and Stats.IOErrors; a Put that fails
//     (ENOSPC, EIO, a read-only file system) returns ErrIO, counts it and
//     leaves the store usable. A directory that refuses writes at Open
//     serves the records it holds and takes no new ones.
//   - A Get reads its record in one preadv, or, for payloads of at least
//     1 MiB read with O_DIRECT, in two preads one after the other (the
//     header sector and the head, then the last eighth of the payload)
//     with the head's CRC beside the second: never two reads of one Get
//     in flight at once, and the payload checksum covers both before Get
//     reports a hit.
//   - O_DIRECT is used where the file system takes it (DirectAuto), with
//     buffered I/O where it does not (tmpfs); Stats.Mode says which.
//     Aligned buffers (4 KiB in address and length, as the engine's pinned
//     slots are) go to the kernel as they are; others are copied through a
//     small pool of aligned bounce buffers.
//
// # Concurrency
//
// Put, Get, Contains, Delete and Clear are safe for concurrent use. One
// mutex guards the index, the free list and the LRU list; no I/O runs under
// it, so many reads and writes are in flight at once (each in its own
// goroutine, each one pwrite, or one or two preads in turn). A slot being
// read is not reused until its readers are done; eviction takes the least
// recently used record that no one is reading. Contains reads memory only.
package disk
