package offload

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/tier/disk"
	"github.com/kvoffload/kvoffload/internal/tiered"
)

// diskEngineConfig is a pool of four 8 KiB slots over a disk tier in dir.
func diskEngineConfig(dir string) Config {
	return Config{PoolBytes: 4 * 8 << 10, Layout: smallLayout(16), Policy: PolicyLRU,
		Disk: &DiskConfig{Dirs: []string{dir}, CapacityBytes: 1 << 20}}
}

// storeOne stores GPU block id under key k and waits for it.
func storeOne(t *testing.T, e *Engine, k Key, id int) Outcome {
	t.Helper()
	ctx := context.Background()
	op, err := e.Store(ctx, []Key{k}, []int{id}, StoreOptions{})
	require.NoError(t, err)
	require.NoError(t, op.Wait(ctx))
	oc, err := op.Outcomes()
	require.NoError(t, err)
	return oc[0]
}

// loadAll loads keys into ids and returns the outcomes.
func loadAll(t *testing.T, e *Engine, keys []Key, ids []int) []Outcome {
	t.Helper()
	ctx := context.Background()
	op, err := e.Load(ctx, keys, ids, LoadOptions{})
	require.NoError(t, err)
	require.NoError(t, op.Wait(ctx))
	oc, err := op.Outcomes()
	require.NoError(t, err)
	return oc
}

// flipRecordByte flips one payload byte of key's record in dir's records
// file (the engine closed).
func flipRecordByte(t *testing.T, dir string, k Key, payload int64) {
	t.Helper()
	flipRecordByteAt(t, dir, k, payload, 4096+100)
}

// flipRecordByteAt flips the byte at offset at of key k's record (its
// header sector is the first 4096 bytes).
func flipRecordByteAt(t *testing.T, dir string, k Key, payload, at int64) {
	t.Helper()
	slotBytes := disk.SlotBytes(payload)
	path := filepath.Join(dir, "records-"+itoa(slotBytes)+".kvo")
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	for off := int64(0); off+slotBytes <= int64(len(b)); off += slotBytes {
		if bytes.Contains(b[off:off+4096], k[:]) {
			f, err := os.OpenFile(path, os.O_RDWR, 0)
			require.NoError(t, err)
			_, err = f.WriteAt([]byte{b[off+at] ^ 0xFF}, off+at)
			require.NoError(t, err)
			require.NoError(t, f.Close())
			return
		}
	}
	t.Fatalf("no record of key %s in %s", k, path)
}

func itoa(n int64) string { return string(appendInt(nil, n)) }

func appendInt(b []byte, n int64) []byte {
	if n >= 10 {
		b = appendInt(b, n/10)
	}
	return append(b, byte('0'+n%10))
}

// TestDiskTier: a pool of four slots over a disk; eight blocks stored (each
// twice, so the admission filter takes them), the four evicted are written
// back; Lookup reports them on disk; Load promotes them byte-exact into
// other GPU blocks; after a restart on the same directory they are found
// and load byte-exact again; a damaged record loads as missing; a second
// engine on the directory is refused.
func TestDiskTier(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	cfg := diskEngineConfig(dir)
	e := newTestEngine(t, cfg)
	require.NotNil(t, e.disk)
	contents := make([][]byte, 8)
	keys := seqKeys(0, 8)
	for i := range 8 {
		contents[i] = fillBlock(t, e, i, byte(10+16*i))
		require.Equal(t, OutcomeStored, storeOne(t, e, keys[i], i))
		require.Equal(t, OutcomeAlreadyPresent, storeOne(t, e, keys[i], i))
	}
	require.NoError(t, e.FlushDisk(ctx))
	st := e.Stats()
	require.Equal(t, int64(4), st.Disk.Writes, "the four evicted blocks were written back")
	require.Equal(t, int64(4), st.Disk.Records)
	require.Equal(t, int64(4*8<<10), st.Disk.Bytes)
	require.Zero(t, st.Disk.Dropped)

	res, err := e.Lookup(keys, LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 0, res.Hits)
	require.Equal(t, 4, res.DiskHits, "keys 0..3 on disk; key 4 is in the pool only")
	res, err = e.Lookup(keys[4:], LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 4, res.Hits)
	require.Equal(t, 0, res.DiskHits)

	// Promote the evicted blocks into GPU blocks 8..11.
	oc := loadAll(t, e, keys[:4], seqIDs(8, 4))
	require.Equal(t, []Outcome{OutcomeLoaded, OutcomeLoaded, OutcomeLoaded, OutcomeLoaded}, oc)
	for i := range 4 {
		require.Equal(t, contents[i], blockBytes(e, 8+i), "block %d promoted byte-exact", i)
	}
	st = e.Stats()
	require.Equal(t, int64(4), st.Disk.Hits)
	require.Zero(t, st.Disk.Misses)
	res, err = e.Lookup(keys[:4], LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 4, res.Hits, "the promoted blocks are in the pool")
	require.NoError(t, e.FlushDisk(ctx))
	require.Equal(t, int64(8), e.Stats().Disk.Writes, "promoting evicted keys 4..7, written back in turn")

	// A second engine on the directory is refused.
	_, err = newEngine(withTestBackend(cfg), engineHooks{})
	require.ErrorIs(t, err, disk.ErrLocked)
	require.ErrorContains(t, err, "disk tier")
	require.NoError(t, e.Close())

	// Restart: the records are found and load byte-exact.
	e2 := newTestEngine(t, cfg)
	res, err = e2.Lookup(keys, LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 0, res.Hits)
	require.Equal(t, 8, res.DiskHits)
	oc = loadAll(t, e2, keys[4:8], seqIDs(12, 4))
	require.Equal(t, []Outcome{OutcomeLoaded, OutcomeLoaded, OutcomeLoaded, OutcomeLoaded}, oc)
	for i := 4; i < 8; i++ {
		require.Equal(t, contents[i], blockBytes(e2, 8+i), "block %d reloaded byte-exact after a restart", i)
	}
	require.NoError(t, e2.Close())

	st = e2.Stats()
	require.Zero(t, st.Disk.TornAtOpen+st.Disk.StaleAtOpen+st.Disk.IOErrors)
	require.Zero(t, st.Disk.UnusableDirs)
	require.Equal(t, 1, st.Disk.Dirs)

	// A damaged record is a miss, never wrong bytes; a damaged header is
	// discarded at start, counted.
	flipRecordByte(t, dir, keys[1], 8<<10)
	flipRecordByteAt(t, dir, keys[2], 8<<10, 24)
	e3 := newTestEngine(t, cfg)
	defer func() { require.NoError(t, e3.Close()) }()
	require.Equal(t, int64(1), e3.Stats().Disk.TornAtOpen, "key 2's header")
	res, err = e3.Lookup(keys[2:3], LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 0, res.Hits+res.DiskHits, "a torn record is not indexed")
	oc = loadAll(t, e3, keys[:2], []int{0, 1})
	require.Equal(t, []Outcome{OutcomeLoaded, OutcomeMissing}, oc)
	require.Equal(t, contents[0], blockBytes(e3, 0))
	st = e3.Stats()
	require.Equal(t, int64(1), st.Disk.Hits)
	require.Equal(t, int64(1), st.Disk.Misses)
	require.Equal(t, int64(1), st.Disk.Corrupt)
	res, err = e3.Lookup(keys[1:2], LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 0, res.Hits+res.DiskHits, "the damaged record was dropped")
}

// storeBlocks fills GPU block i with seed+step·i's content, stores keys[i]
// from it, checks it was stored, and returns the contents.
func storeBlocks(t *testing.T, e *Engine, keys []Key, seed, step byte) [][]byte {
	t.Helper()
	contents := make([][]byte, len(keys))
	for i := range keys {
		contents[i] = fillBlock(t, e, i, seed+step*byte(i))
		require.Equal(t, OutcomeStored, storeOne(t, e, keys[i], i))
	}
	return contents
}

// requireLoads loads keys into GPU blocks from, from+1, … and checks that
// each is loaded and holds contents[i].
func requireLoads(t *testing.T, e *Engine, keys []Key, from int, contents [][]byte, what string) {
	t.Helper()
	oc := loadAll(t, e, keys, seqIDs(from, len(keys)))
	for i := range keys {
		require.Equal(t, OutcomeLoaded, oc[i], "%s: block %d", what, i)
		require.Equal(t, contents[i], blockBytes(e, from+i), "%s: block %d byte-exact", what, i)
	}
}

// withTestBackend is what newTestEngine sets.
func withTestBackend(cfg Config) Config {
	cfg.Backend = BackendHost
	cfg.SkipMemoryCheck = true
	return cfg
}

// TestDiskAdmission: blocks stored once are not written back by default.
func TestDiskAdmission(t *testing.T) {
	e := newTestEngine(t, diskEngineConfig(t.TempDir()))
	defer func() { require.NoError(t, e.Close()) }()
	for i := range 8 {
		fillBlock(t, e, i, byte(i))
		require.Equal(t, OutcomeStored, storeOne(t, e, testKey(i), i))
	}
	require.NoError(t, e.FlushDisk(context.Background()))
	st := e.Stats()
	require.Equal(t, int64(4), st.Disk.NotAdmitted)
	require.Zero(t, st.Disk.Writes)
	require.Zero(t, st.Disk.Records)
}

// TestDiskWriteBackDrops: with one write-back buffer held by a write in
// progress, the next eviction is dropped and counted, never waited for.
func TestDiskWriteBackDrops(t *testing.T) {
	cfg := withTestBackend(diskEngineConfig(t.TempDir()))
	cfg.Disk.AdmitAll = true
	cfg.Disk.WriteBackBytes = 8 << 10
	entered, proceed := make(chan struct{}, 8), make(chan struct{})
	e, err := newEngine(cfg, engineHooks{beforeDiskPut: func(Key) {
		entered <- struct{}{}
		<-proceed
	}})
	require.NoError(t, err)
	defer func() { require.NoError(t, e.Close()) }()
	for i := range 5 {
		fillBlock(t, e, i, byte(i))
		require.Equal(t, OutcomeStored, storeOne(t, e, testKey(i), i))
	}
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the first eviction's write-back never started")
	}
	fillBlock(t, e, 5, 5)
	require.Equal(t, OutcomeStored, storeOne(t, e, testKey(5), 5), "the store never waits for the disk")
	require.Equal(t, int64(1), e.Stats().Disk.Dropped)
	close(proceed)
	require.NoError(t, e.FlushDisk(context.Background()))
	st := e.Stats()
	require.Equal(t, int64(1), st.Disk.Writes)
	require.Equal(t, int64(1), st.Disk.Records)
}

// TestDiskDelete: Delete removes a block from the disk tier too, and Clear
// empties it.
func TestDiskDelete(t *testing.T) {
	cfg := diskEngineConfig(t.TempDir())
	cfg.Disk.AdmitAll = true
	e := newTestEngine(t, cfg)
	defer func() { require.NoError(t, e.Close()) }()
	for i := range 6 {
		fillBlock(t, e, i, byte(i))
		require.Equal(t, OutcomeStored, storeOne(t, e, testKey(i), i))
	}
	require.NoError(t, e.FlushDisk(context.Background()))
	res, err := e.Lookup(seqKeys(0, 2), LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 2, res.DiskHits)
	_, err = e.Delete([]Key{testKey(0)})
	require.NoError(t, err)
	res, err = e.Lookup(seqKeys(0, 2), LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 0, res.DiskHits)
	require.Equal(t, OutcomeMissing, loadAll(t, e, []Key{testKey(0)}, []int{9})[0])
	_, err = e.Clear(e.Config().Namespace)
	require.NoError(t, err)
	require.Zero(t, e.Stats().Disk.Records)
}

// TestDiskConfig: the disk tier's settings are checked by New.
func TestDiskConfig(t *testing.T) {
	for _, d := range []DiskConfig{
		{CapacityBytes: 1 << 20},
		{Dirs: []string{"x"}},
		{Dirs: []string{"x"}, CapacityBytes: 1 << 20, Fsync: "sometimes"},
		{Dirs: []string{"x"}, CapacityBytes: 1 << 20, Direct: "maybe"},
		{Dirs: []string{"x"}, CapacityBytes: 1 << 20, WriteBackBytes: -1},
	} {
		_, _, _, err := withDefaults(Config{PoolBytes: 1 << 20, Layout: smallLayout(8), Disk: &d})
		require.ErrorIs(t, err, ErrInvalidConfig, "%+v", d)
	}
	d := &DiskConfig{Dirs: []string{"x"}, CapacityBytes: 1 << 20}
	cfg, _, _, err := withDefaults(Config{PoolBytes: 1 << 20, Layout: smallLayout(8), Disk: d})
	require.NoError(t, err)
	require.Equal(t, DiskFsyncNone, cfg.Disk.Fsync)
	require.Equal(t, DiskDirectAuto, cfg.Disk.Direct)
	require.Equal(t, DefaultWriteBackBytes, cfg.Disk.WriteBackBytes)
	require.Equal(t, tiered.DefaultWriteBackBytes, DefaultWriteBackBytes, "the tier's default, as the node's")
	require.Empty(t, d.Fsync, "the caller's DiskConfig is not changed")
}

// TestDiskConcurrent: goroutines store and load keys through a pool of four
// slots over the disk tier, with a write-back pool of two blocks: every
// block loaded holds its key's bytes, whichever tier it came from.
func TestDiskConcurrent(t *testing.T) {
	cfg := diskEngineConfig(t.TempDir())
	cfg.Disk.AdmitAll = true
	cfg.Disk.WriteBackBytes = 2 * 8 << 10
	e := newTestEngine(t, cfg)
	defer func() { require.NoError(t, e.Close()) }()
	segs, err := e.layout.Segments(0, nil)
	require.NoError(t, err)
	want := func(k int) []byte {
		out := make([]byte, e.slot)
		for _, s := range segs {
			copy(out[s.Off:], bytes.Repeat([]byte{byte(k) + byte(s.Off/2048)}, int(s.Len)))
		}
		return out
	}
	write := func(id, k int) error {
		ss, err := e.layout.Segments(id, nil)
		if err != nil {
			return err
		}
		b := want(k)
		for _, s := range ss {
			if err := e.sim.Write(s.Dev, b[s.Off:s.Off+s.Len]); err != nil {
				return err
			}
		}
		return nil
	}
	ctx := context.Background()
	errs := make(chan error, 4)
	for g := range 4 {
		go func() {
			errs <- func() error {
				for it := range 60 {
					id := g*4 + it%4
					k := (g*7 + it*5) % 24
					if err := write(id, k); err != nil {
						return err
					}
					op, err := e.Store(ctx, []Key{testKey(k)}, []int{id}, StoreOptions{})
					if err != nil {
						return err
					}
					if err := op.Wait(ctx); err != nil {
						return err
					}
					j := (k + 3 + g) % 24
					dst := g*4 + (it+1)%4
					op, err = e.Load(ctx, []Key{testKey(j)}, []int{dst}, LoadOptions{})
					if errors.Is(err, ErrBusy) {
						continue
					}
					if err != nil {
						return err
					}
					if err := op.Wait(ctx); err != nil {
						return err
					}
					if op.count(OutcomeLoaded) == 1 && !bytes.Equal(blockBytes(e, dst), want(j)) {
						return fmt.Errorf("key %d loaded into block %d with the wrong bytes", j, dst)
					}
				}
				return nil
			}()
		}()
	}
	for range 4 {
		require.NoError(t, <-errs)
	}
	require.NoError(t, e.FlushDisk(ctx))
	st := e.Stats()
	t.Logf("disk: %d writes, %d dropped, %d hits, %d misses, %d records", st.Disk.Writes, st.Disk.Dropped, st.Disk.Hits, st.Disk.Misses, st.Disk.Records)
	require.Positive(t, st.Disk.Writes)
	require.Positive(t, st.Disk.Hits)
	require.Zero(t, st.Disk.Misses)
}

// diskEvents drains the MediumDisk events now in s.
func diskEvents(s *EventStream) []Event {
	var out []Event
	for {
		select {
		case ev := <-s.C:
			if ev.Medium == MediumDisk {
				out = append(out, ev)
			}
		default:
			return out
		}
	}
}

// TestDiskEvents: a block written back to disk is a BlockStored of medium
// "DISK" (after its host copy's BlockRemoved "CPU"); deleted or cleared
// from disk, a BlockRemoved "DISK".
func TestDiskEvents(t *testing.T) {
	cfg := diskEngineConfig(t.TempDir())
	cfg.Disk.AdmitAll = true
	e := newTestEngine(t, cfg)
	defer func() { require.NoError(t, e.Close()) }()
	s := e.Events(0)
	for i := range 6 { // four slots: keys 0 and 1 are evicted, written back
		fillBlock(t, e, i, byte(i))
		require.Equal(t, OutcomeStored, storeOne(t, e, testKey(i), i))
	}
	require.NoError(t, e.FlushDisk(context.Background()))
	evs := diskEvents(s)
	require.Len(t, evs, 2)
	require.ElementsMatch(t, []Key{testKey(0), testKey(1)}, []Key{evs[0].Key, evs[1].Key})
	for _, ev := range evs {
		require.Equal(t, EventStored, ev.Kind)
		require.Equal(t, "DISK", ev.Medium)
		require.Equal(t, 16, ev.BlockSize)
	}
	_, err := e.Delete([]Key{testKey(0)})
	require.NoError(t, err)
	require.Equal(t, []Event{{Kind: EventRemoved, Key: testKey(0), BlockSize: 16, Medium: MediumDisk}}, diskEvents(s))
	_, err = e.Clear(e.Config().Namespace)
	require.NoError(t, err)
	require.Equal(t, []Event{{Kind: EventRemoved, Key: testKey(1), BlockSize: 16, Medium: MediumDisk}}, diskEvents(s))
}

// recordsFile returns the bytes of dir's records file of the engine's slot.
func recordsFile(t *testing.T, e *Engine, dir string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, fmt.Sprintf("records-%d.kvo", disk.SlotBytes(e.slot))))
	require.NoError(t, err)
	return b
}

// TestDiskZeroOnRelease: with Config.ZeroOnRelease, a block deleted from
// the disk tier leaves neither its bytes nor its key in the records file;
// without it, the bytes stay (only the header is invalidated).
func TestDiskZeroOnRelease(t *testing.T) {
	for _, zero := range []bool{false, true} {
		t.Run(fmt.Sprint("zero=", zero), func(t *testing.T) {
			dir := t.TempDir()
			cfg := diskEngineConfig(dir)
			cfg.Disk.AdmitAll = true
			cfg.ZeroOnRelease = zero
			e := newTestEngine(t, cfg)
			defer func() { require.NoError(t, e.Close()) }()
			contents := make([][]byte, 6)
			for i := range 6 {
				contents[i] = fillBlock(t, e, i, byte(0x20+8*i))
				require.Equal(t, OutcomeStored, storeOne(t, e, testKey(i), i))
			}
			require.NoError(t, e.FlushDisk(context.Background()))
			b := recordsFile(t, e, dir)
			require.True(t, bytes.Contains(b, contents[0]), "key 0's block is on disk")
			require.True(t, bytes.Contains(b, keyBytes(testKey(0))))
			_, err := e.Delete([]Key{testKey(0)})
			require.NoError(t, err)
			b = recordsFile(t, e, dir)
			require.False(t, bytes.Contains(b, keyBytes(testKey(0))), "the header is gone")
			require.Equal(t, !zero, bytes.Contains(b, contents[0]), "the payload is gone with ZeroOnRelease only")
			require.True(t, bytes.Contains(b, contents[1]), "key 1's record is untouched")
		})
	}
}

func keyBytes(k Key) []byte { return k[:] }

// diskFaultEngine is a disk-tier engine whose disk I/O of kind op fails
// with errno while *on.
func diskFaultEngine(t *testing.T, cfg Config, op disk.FaultOp, errno error, on *atomic.Bool) *Engine {
	t.Helper()
	e, err := newEngine(withTestBackend(cfg), engineHooks{diskFaults: func(o disk.FaultOp, _ string) error {
		if o == op && on.Load() {
			return errno
		}
		return nil
	}})
	require.NoError(t, err)
	return e
}

// TestDiskFaults: ENOSPC and EIO on the disk tier, and a directory that
// refuses writes, never fail a Store or a Load: the engine serves from
// host memory, a write that fails is counted (Disk.WriteErrors), a read that
// fails is a missing block, counted (Disk.Misses).
func TestDiskFaults(t *testing.T) {
	ctx := context.Background()
	for name, errno := range map[string]error{"ENOSPC": unix.ENOSPC, "EIO": unix.EIO} {
		t.Run(name+"/write", func(t *testing.T) {
			cfg := diskEngineConfig(t.TempDir())
			cfg.Disk.AdmitAll = true
			var on atomic.Bool
			on.Store(true)
			e := diskFaultEngine(t, cfg, disk.FaultWrite, errno, &on)
			defer func() { require.NoError(t, e.Close()) }()
			contents := make([][]byte, 6)
			for i := range 6 {
				contents[i] = fillBlock(t, e, i, byte(0x20+8*i))
				require.Equal(t, OutcomeStored, storeOne(t, e, testKey(i), i))
			}
			require.NoError(t, e.FlushDisk(ctx))
			st := e.Stats()
			require.Equal(t, int64(2), st.Disk.WriteErrors)
			require.Zero(t, st.Disk.Writes)
			require.Zero(t, st.Disk.Records)
			oc := loadAll(t, e, seqKeys(0, 6), seqIDs(8, 6))
			require.Equal(t, []Outcome{OutcomeMissing, OutcomeMissing, OutcomeLoaded, OutcomeLoaded, OutcomeLoaded, OutcomeLoaded}, oc)
			for i := 2; i < 6; i++ {
				require.Equal(t, contents[i], blockBytes(e, 8+i), "served from host memory")
			}
			on.Store(false)
			fillBlock(t, e, 6, 0x90)
			require.Equal(t, OutcomeStored, storeOne(t, e, testKey(6), 6))
			require.NoError(t, e.FlushDisk(ctx))
			require.Equal(t, int64(1), e.Stats().Disk.Writes, "the disk tier works again once the fault is gone")
		})
		t.Run(name+"/read", func(t *testing.T) {
			cfg := diskEngineConfig(t.TempDir())
			cfg.Disk.AdmitAll = true
			var on atomic.Bool
			e := diskFaultEngine(t, cfg, disk.FaultRead, errno, &on)
			defer func() { require.NoError(t, e.Close()) }()
			for i := range 6 {
				fillBlock(t, e, i, byte(0x20+8*i))
				require.Equal(t, OutcomeStored, storeOne(t, e, testKey(i), i))
			}
			require.NoError(t, e.FlushDisk(ctx))
			require.Equal(t, int64(2), e.Stats().Disk.Records, "%+v", e.Stats())
			on.Store(true)
			oc := loadAll(t, e, seqKeys(0, 2), seqIDs(8, 2))
			require.Equal(t, []Outcome{OutcomeMissing, OutcomeMissing}, oc, "a failed read is a missing block, not an error")
			// The failed promotion had reserved two host slots (evicting
			// keys 2 and 3) before its reads failed; the rest is served
			// from host memory.
			oc = loadAll(t, e, seqKeys(4, 2), seqIDs(10, 2))
			require.Equal(t, []Outcome{OutcomeLoaded, OutcomeLoaded}, oc, "served from host memory")
			st := e.Stats()
			require.Equal(t, int64(2), st.Disk.Misses)
			require.Zero(t, st.Disk.Hits)
			res, err := e.Lookup(seqKeys(0, 2), LookupOptions{})
			require.NoError(t, err)
			require.Zero(t, res.Hits+res.DiskHits, "records that failed to read are dropped")
		})
	}
	t.Run("read-only", func(t *testing.T) {
		dir := t.TempDir()
		cfg := diskEngineConfig(dir)
		cfg.Disk.AdmitAll = true
		e := newTestEngine(t, cfg)
		contents := make([][]byte, 6)
		for i := range 6 {
			contents[i] = fillBlock(t, e, i, byte(0x20+8*i))
			require.Equal(t, OutcomeStored, storeOne(t, e, testKey(i), i))
		}
		require.NoError(t, e.Close())
		// The directory refuses writes (EROFS at open, as a read-only
		// mount gives; chmod would not stop root): its records are served,
		// new write-backs are counted failures.
		var on atomic.Bool
		on.Store(true)
		e = diskFaultEngine(t, cfg, disk.FaultOpen, unix.EROFS, &on)
		defer func() { require.NoError(t, e.Close()) }()
		oc := loadAll(t, e, seqKeys(0, 2), seqIDs(8, 2))
		require.Equal(t, []Outcome{OutcomeLoaded, OutcomeLoaded}, oc)
		require.Equal(t, contents[0], blockBytes(e, 8))
		require.Equal(t, contents[1], blockBytes(e, 9))
		for i := 2; i < 8; i++ {
			fillBlock(t, e, i, byte(0x20+8*i))
			require.Equal(t, OutcomeStored, storeOne(t, e, testKey(i), i))
		}
		require.NoError(t, e.FlushDisk(ctx))
		st := e.Stats()
		require.Equal(t, int64(2), st.Disk.Hits)
		require.Positive(t, st.Disk.WriteErrors)
		require.Zero(t, st.Disk.Writes)
		require.Equal(t, int64(2), st.Disk.Records)
	})
}

// TestDiskFingerprint: every field of the fingerprint changes it, and
// records written under another namespace are misses after a restart.
func TestDiskFingerprint(t *testing.T) {
	base := Config{Namespace: "m", Layout: smallLayout(8)}
	fp0, err := recordFingerprint(base)
	require.NoError(t, err)
	for name, change := range map[string]func(*Config){
		"namespace":  func(c *Config) { c.Namespace = "other" },
		"kind":       func(c *Config) { c.Layout.Kind = LayoutCrossLayer },
		"layers":     func(c *Config) { c.Layout.Layers++ },
		"kv heads":   func(c *Config) { c.Layout.KVHeads++ },
		"head dim":   func(c *Config) { c.Layout.HeadDim++ },
		"dtype":      func(c *Config) { c.Layout.DTypeBytes = 1 },
		"block size": func(c *Config) { c.Layout.TokensPerBlock++ },
	} {
		c := base
		change(&c)
		fp, err := recordFingerprint(c)
		require.NoError(t, err)
		require.NotEqual(t, fp0, fp, name)
	}

	dir := t.TempDir()
	cfg := diskEngineConfig(dir)
	cfg.Disk.AdmitAll = true
	cfg.Namespace = "model-a"
	e := newTestEngine(t, cfg)
	for i := range 6 {
		fillBlock(t, e, i, byte(i))
		require.Equal(t, OutcomeStored, storeOne(t, e, testKey(i), i))
	}
	require.NoError(t, e.Close())
	cfg.Namespace = "model-b"
	e = newTestEngine(t, cfg)
	defer func() { require.NoError(t, e.Close()) }()
	st := e.Stats()
	require.Zero(t, st.Disk.Records, "another namespace's records are not served")
	res, err := e.Lookup(seqKeys(0, 2), LookupOptions{})
	require.NoError(t, err)
	require.Zero(t, res.DiskHits)
}

// TestDiskClearRace: blocks of the cleared namespace evicted to disk while
// Clear runs (after the disk tier's first clear, before the cache's) leave
// no record behind once Clear has returned.
func TestDiskClearRace(t *testing.T) {
	cfg := diskEngineConfig(t.TempDir())
	cfg.Disk.AdmitAll = true
	cfg.Backend, cfg.SkipMemoryCheck = BackendHost, true
	var e *Engine
	evicted := false
	e, err := newEngine(cfg, engineHooks{afterDiskClear: func() {
		if evicted {
			return
		}
		evicted = true
		// Another namespace's blocks take the whole pool: the cleared
		// namespace's blocks go to disk now.
		op, err := e.Store(context.Background(), seqKeys(100, 4), []int{4, 5, 6, 7}, StoreOptions{Namespace: "other"})
		require.NoError(t, err)
		require.NoError(t, op.Wait(context.Background()))
		require.NoError(t, op.Release())
		require.NoError(t, e.FlushDisk(context.Background()))
	}})
	require.NoError(t, err)
	defer func() { require.NoError(t, e.Close()) }()
	for i := range 4 {
		fillBlock(t, e, i, byte(i))
		require.Equal(t, OutcomeStored, storeOne(t, e, testKey(i), i))
	}
	_, err = e.Clear(e.Config().Namespace)
	require.NoError(t, err)
	require.True(t, evicted)
	require.NoError(t, e.FlushDisk(context.Background()))
	res, err := e.Lookup(seqKeys(0, 4), LookupOptions{})
	require.NoError(t, err)
	require.Zero(t, res.Hits+res.DiskHits, "a block of the cleared namespace survived Clear")
	require.Zero(t, e.Stats().Disk.Records)
}

// TestDiskWriteThrough: with DiskConfig.WriteThrough every stored block is
// on disk once its store completes, evicted or not, so a restart finds all
// of them (byte-exact); AdmitAfter sets the write-back filter's count; a
// bad AdmitAfter is refused.
func TestDiskWriteThrough(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	cfg := diskEngineConfig(dir)
	cfg.Disk.WriteThrough = true
	e := newTestEngine(t, cfg)
	keys := seqKeys(0, 3)
	contents := storeBlocks(t, e, keys, 9, 17)
	require.NoError(t, e.FlushDisk(ctx))
	st := e.Stats()
	require.Equal(t, int64(3), st.Disk.WriteThroughs)
	require.Equal(t, int64(3), st.Disk.Writes)
	require.Equal(t, int64(3), st.Disk.Records, "in the pool and on disk")
	res, err := e.Lookup(keys, LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 3, res.Hits)
	require.NoError(t, e.Close())

	e2 := newTestEngine(t, cfg)
	res, err = e2.Lookup(keys, LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 3, res.DiskHits, "a restart finds blocks never evicted")
	requireLoads(t, e2, keys, 8, contents, "written through, found after a restart")
	require.NoError(t, e2.Close())

	// AdmitAfter 3: blocks stored twice are not written back when evicted,
	// blocks stored three times are.
	cfg = diskEngineConfig(t.TempDir())
	cfg.Disk.AdmitAfter = 3
	e3 := newTestEngine(t, cfg)
	defer func() { require.NoError(t, e3.Close()) }()
	keys = seqKeys(100, 8)
	for i := range keys {
		fillBlock(t, e3, i, byte(i))
		times := 2
		if i%2 == 1 {
			times = 3
		}
		for range times {
			storeOne(t, e3, keys[i], i)
		}
	}
	require.NoError(t, e3.FlushDisk(ctx))
	res, err = e3.Lookup(keys[1:2], LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 1, res.DiskHits, "seen three times: written back")
	res, err = e3.Lookup(keys[0:1], LookupOptions{})
	require.NoError(t, err)
	require.Zero(t, res.DiskHits, "seen twice: kept off disk")
	require.Positive(t, e3.Stats().Disk.NotAdmitted)

	for _, bad := range []int{-1, 256} {
		c := diskEngineConfig(t.TempDir())
		c.Disk.AdmitAfter = bad
		_, err := newEngine(withTestBackend(c), engineHooks{})
		require.ErrorIs(t, err, ErrInvalidConfig, "%d", bad)
		require.ErrorContains(t, err, "AdmitAfter")
	}
}

// TestDiskNoUsableDir: a disk tier none of whose directories can be used
// at New (ENOSPC creating the records file) leaves the engine serving from
// host memory, saying why; stores, loads and Prefetch work without it.
func TestDiskNoUsableDir(t *testing.T) {
	var on atomic.Bool
	on.Store(true)
	e := diskFaultEngine(t, diskEngineConfig(t.TempDir()), disk.FaultOpen, syscall.ENOSPC, &on)
	defer func() { require.NoError(t, e.Close()) }()
	st := e.Stats()
	require.Equal(t, "off", st.Disk.Mode)
	require.Contains(t, st.Disk.Error, "no usable directory")
	require.Equal(t, 1, st.Disk.UnusableDirs)
	keys := seqKeys(0, 2)
	contents := storeBlocks(t, e, keys, 3, 1)
	requireLoads(t, e, keys, 8, contents, "served from host memory")
	require.NoError(t, e.FlushDisk(context.Background()))
	pr, err := e.Prefetch(context.Background(), seqKeys(10, 2), PrefetchOptions{})
	require.NoError(t, err)
	require.Zero(t, pr.Promoted)
}

// TestDiskWriteBackOnClose: Close writes the pool's blocks that are not on
// disk (none evicted, the admission filter aside), so a restart finds
// them all and loads them byte-exact; without the option it finds none; a
// block already on disk is not written again; Close with a context that
// has ended writes nothing more.
func TestDiskWriteBackOnClose(t *testing.T) {
	dir := t.TempDir()
	cfg := diskEngineConfig(dir)
	e := newTestEngine(t, cfg)
	keys := seqKeys(0, 4)
	storeBlocks(t, e, keys, 9, 17)
	require.NoError(t, e.Close())
	require.Zero(t, e.Stats().Disk.WrittenAtClose)
	e2 := newTestEngine(t, cfg)
	res, err := e2.Lookup(keys, LookupOptions{})
	require.NoError(t, err)
	require.Zero(t, res.DiskHits, "without WriteBackOnClose the pool's blocks are gone")
	require.NoError(t, e2.Close())

	cfg.Disk.WriteBackOnClose = true
	e3 := newTestEngine(t, cfg)
	contents := storeBlocks(t, e3, keys, 9, 17)
	require.NoError(t, e3.Close())
	st := e3.Stats()
	require.Equal(t, int64(4), st.Disk.WrittenAtClose)
	require.Zero(t, st.Disk.Writes, "not counted as write-backs")

	e4 := newTestEngine(t, cfg)
	res, err = e4.Lookup(keys, LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 4, res.DiskHits, "a restart finds what the pool held")
	requireLoads(t, e4, keys, 8, contents, "written back at Close, found after a restart")
	// The loaded blocks are in the pool and on disk: Close writes the one
	// stored since, not them again.
	more := seqKeys(10, 1)
	storeBlocks(t, e4, more, 3, 5)
	require.NoError(t, e4.Close())
	require.Equal(t, int64(1), e4.Stats().Disk.WrittenAtClose)

	// A context already ended: Close writes nothing, and still closes (the
	// directory's lock is let go).
	e5 := newTestEngine(t, cfg)
	late := seqKeys(20, 3)
	storeBlocks(t, e5, late, 3, 5)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_ = e5.CloseContext(ctx)
	var e6 *Engine
	require.Eventually(t, func() bool {
		var err error
		e6, err = New(cfg)
		return err == nil
	}, 5*time.Second, 10*time.Millisecond)
	defer func() { require.NoError(t, e6.Close()) }()
	res, err = e6.Lookup(late, LookupOptions{})
	require.NoError(t, err)
	require.Zero(t, res.DiskHits)
	require.Zero(t, e5.Stats().Disk.WrittenAtClose)
}
