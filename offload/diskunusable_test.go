package offload

import (
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestDiskUnusableError: a directory of Disk.Dirs the tier cannot use is
// counted and says why (Stats.Disk.UnusableError), with the tier on over
// the others and with the tier off.
func TestDiskUnusableError(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing")
	cfg := diskEngineConfig(t.TempDir())
	cfg.Disk.Dirs = append(cfg.Disk.Dirs, missing)
	e := newTestEngine(t, cfg)
	st := e.Stats()
	require.Empty(t, st.Disk.Error, "the tier is on over the first directory")
	require.Equal(t, 1, st.Disk.UnusableDirs)
	require.Contains(t, st.Disk.UnusableError, missing)
	require.Contains(t, st.Disk.UnusableError, "no such file or directory")
	require.NoError(t, e.Close())

	e = newTestEngine(t, diskEngineConfig(missing))
	st = e.Stats()
	require.Equal(t, "off", st.Disk.Mode)
	require.Contains(t, st.Disk.Error, missing)
	require.Equal(t, st.Disk.Error, st.Disk.UnusableError)
	require.NoError(t, e.Close())

	e = newTestEngine(t, diskEngineConfig(t.TempDir()))
	require.Empty(t, e.Stats().Disk.UnusableError)
	require.NoError(t, e.Close())
}
