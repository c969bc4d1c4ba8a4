package offload

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/tier/disk"
)

// otherRecordsName is the name of the records file an engine of slot bytes
// keeps in its disk directory.
func otherRecordsName(slot int64) string { return fmt.Sprintf("records-%d.kvo", disk.SlotBytes(slot)) }

// TestDiskOtherLayoutKept: two engines of two layouts (two slot sizes) on
// one disk directory, one after the other: the second keeps the first's
// records file (another model's blocks) beside its own, and each engine,
// reopened, loads its blocks byte-exact from disk. With
// DiskConfig.RemoveRecords naming the other layout's file, New removes that
// file only; naming the engine's own file is ErrInvalidConfig.
func TestDiskOtherLayoutKept(t *testing.T) {
	dir := t.TempDir()
	a := diskEngineConfig(dir)
	a.Disk.WriteBackOnClose = true
	b := diskEngineConfig(dir)
	b.Layout.HeadDim = 128 // slots twice as large: another records file
	b.PoolBytes *= 2
	b.Disk.WriteBackOnClose = true
	keysA, keysB := seqKeys(0, 4), seqKeys(100, 4)

	ea := newTestEngine(t, a)
	contentsA := storeBlocks(t, ea, keysA, 9, 17)
	slotA := ea.slot
	require.NoError(t, ea.Close())
	eb := newTestEngine(t, b)
	require.NotEqual(t, slotA, eb.slot)
	contentsB := storeBlocks(t, eb, keysB, 3, 5)
	slotB := eb.slot
	require.NoError(t, eb.Close())
	for _, f := range []string{otherRecordsName(slotA), otherRecordsName(slotB)} {
		_, err := os.Stat(filepath.Join(dir, f))
		require.NoError(t, err, "%s kept", f)
	}

	ea = newTestEngine(t, a)
	requireLoads(t, ea, keysA, 8, contentsA, "layout A's records after an engine of layout B")
	require.NoError(t, ea.Close())

	bad := b
	bad.Disk = &DiskConfig{Dirs: []string{dir}, CapacityBytes: 1 << 20, RemoveRecords: []string{otherRecordsName(slotB)}}
	_, err := newEngine(withTestBackend(bad), engineHooks{})
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.ErrorContains(t, err, otherRecordsName(slotB))

	b.Disk.RemoveRecords = []string{otherRecordsName(slotA)}
	eb = newTestEngine(t, b)
	requireLoads(t, eb, keysB, 8, contentsB, "layout B's records, layout A's removed by name")
	require.NoError(t, eb.Close())
	_, err = os.Stat(filepath.Join(dir, otherRecordsName(slotA)))
	require.ErrorIs(t, err, os.ErrNotExist, "the named file is removed")
}
