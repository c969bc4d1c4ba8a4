package disk

import (
	"errors"
	"fmt"
)

// IOMode is the kind of I/O a store does, over its directories.
type IOMode uint8

const (
	// IODirect: O_DIRECT in every directory.
	IODirect IOMode = iota + 1
	// IOBuffered: the page cache in every directory.
	IOBuffered
	// IOMixed: O_DIRECT in some directories only (Stats.DirectDirs).
	IOMixed
)

func (m IOMode) String() string {
	switch m {
	case IODirect:
		return "direct"
	case IOBuffered:
		return "buffered"
	case IOMixed:
		return "mixed"
	}
	return fmt.Sprintf("IOMode(%d)", uint8(m))
}

// Stats is a snapshot of a store's counters. Counts are since Open.
type Stats struct {
	Records         int64 // readable records
	Bytes           int64 // their payload bytes
	CapacityRecords int64 // slots in the usable directories
	Hits            int64 // Gets that returned a verified record
	Misses          int64 // Gets that returned false, Corrupt and I/O errors included
	Corrupt         int64 // Gets that found a record failing a check (dropped, a miss)
	TornAtOpen      int64 // slots whose header was damaged, or whose payload was cut off, at Open
	StaleAtOpen     int64 // records of another format version, fingerprint, layout version or size at Open, and second copies of a key
	IOErrors        int64 // failed reads and writes (each a miss or a dropped Put)
	NoSpace         int64 // the IOErrors that were ENOSPC or EDQUOT
	Evictions       int64 // records evicted (least recently used) to make room
	Dropped         int64 // Puts refused because every slot was busy
	Mode            IOMode
	Dirs            int // usable directories
	DirectDirs      int // those with O_DIRECT in effect
	ReadOnlyDirs    int // those that serve their records but take no new ones
	UnusableDirs    int // directories of Config.Dirs left out at Open (see Open's doc)
}

// Stats returns the store's counters.
func (s *Store) Stats() Stats {
	s.mu.Lock()
	st := Stats{
		Records:         s.ready,
		Bytes:           s.ready * s.cfg.RecordPayloadBytes,
		CapacityRecords: int64(len(s.slots)),
	}
	s.mu.Unlock()
	st.Hits, st.Misses, st.Corrupt = s.hits.Load(), s.misses.Load(), s.corrupt.Load()
	st.IOErrors, st.NoSpace = s.ioErrors.Load(), s.noSpace.Load()
	st.Evictions, st.Dropped = s.evictions.Load(), s.dropped.Load()
	st.TornAtOpen, st.StaleAtOpen = s.torn, s.stale
	st.Dirs, st.ReadOnlyDirs, st.UnusableDirs = len(s.dirs), s.readOnlyDirs, len(s.unusable)
	for _, d := range s.dirs {
		if d.direct {
			st.DirectDirs++
		}
	}
	switch st.DirectDirs {
	case st.Dirs:
		st.Mode = IODirect
	case 0:
		st.Mode = IOBuffered
	default:
		st.Mode = IOMixed
	}
	return st
}

// UnusableError is why the directories counted in Stats.UnusableDirs were
// left out at Open, each one's error joined (nil when none was).
func (s *Store) UnusableError() error { return errors.Join(s.unusable...) }
