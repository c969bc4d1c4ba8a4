package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/offload"
	"github.com/kvoffload/kvoffload/tier/disk"
)

// tinyDiskArgs are a short demo's arguments with --disk dirs.
func tinyDiskArgs(dirs string, more ...string) []string {
	return append([]string{"demo", "--backend", "host", "--layout", "tiny", "--pool-bytes", "1MiB", "--gpu-blocks", "32",
		"--requests", "10", "--duration", "0", "--pinning", "none", "--disk", dirs}, more...)
}

// requireDiskRefused runs the demo on dirs and checks that it fails
// (exit 1) naming --disk and each of want, with no report (and no promise
// that Close writes blocks for the next run).
func requireDiskRefused(t *testing.T, dirs string, want ...string) {
	t.Helper()
	code, out, errs := runCLI(t, tinyDiskArgs(dirs)...)
	require.Equal(t, exitError, code, "stdout %s\nstderr %s", out, errs)
	require.Contains(t, errs, "--disk "+dirs)
	for _, w := range want {
		require.Contains(t, errs, w)
	}
	require.NotContains(t, out, "for the next run")
}

// TestDemoDiskUnusable: `demo --disk` on a directory the disk tier cannot
// use (missing, a regular file, one of two missing) fails, exit 1, with the
// reason, instead of running without the tier.
func TestDemoDiskUnusable(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "no-such-dir")
	requireDiskRefused(t, missing, "the disk tier is off", missing, "no such file or directory")

	file := filepath.Join(t.TempDir(), "a-file")
	require.NoError(t, os.WriteFile(file, []byte("x"), 0o600))
	requireDiskRefused(t, file, "the disk tier is off", file, "not a directory")

	good := t.TempDir()
	requireDiskRefused(t, good+","+missing, "1 of its 2 directories unusable", missing, "no such file or directory")

	// A usable directory still runs, its report saying what Close does.
	code, out, errs := runCLI(t, tinyDiskArgs(good)...)
	require.Equal(t, exitOK, code, errs)
	require.Contains(t, out, "for the next run")
}

// TestDemoDiskNoSpace: the records file's fallocate failing with ENOSPC
// (injected through the simulated machine's disk: no root needed) fails
// the demo naming the directory, fallocate and ENOSPC.
func TestDemoDiskNoSpace(t *testing.T) {
	cfg := tinyDemo(offload.BackendHost)
	cfg.diskDir = t.TempDir()
	cfg.diskFaults = func(op disk.FaultOp, dir string) error {
		if op == disk.FaultFallocate {
			return unix.ENOSPC
		}
		return nil
	}
	rep, err := runDemo(context.Background(), cfg, nil, noNotice)
	require.Nil(t, rep)
	require.Error(t, err)
	require.NotErrorIs(t, err, errUsage)
	for _, w := range []string{"--disk " + cfg.diskDir, "the disk tier is off", "fallocate", "no space left on device"} {
		require.ErrorContains(t, err, w)
	}
}

// TestDemoDiskNoSpaceTmpfs is TestDemoDiskNoSpace on a real file system
// too small for the records file (a 64 KiB tmpfs, mounted as root).
func TestDemoDiskNoSpaceTmpfs(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs needs root (TestDemoDiskNoSpace injects the ENOSPC instead)")
	}
	dir := t.TempDir()
	require.NoError(t, unix.Mount("tmpfs", dir, "tmpfs", 0, "size=64k,mode=0700"))
	t.Cleanup(func() { _ = unix.Unmount(dir, 0) })
	code, out, errs := runCLI(t, tinyDiskArgs(dir, "--disk-bytes", "4MiB")...)
	require.Equal(t, exitError, code, "stdout %s\nstderr %s", out, errs)
	for _, w := range []string{"--disk " + dir, "fallocate", "no space left on device"} {
		require.Contains(t, errs, w)
	}
	require.False(t, strings.Contains(out, "for the next run"))
}
