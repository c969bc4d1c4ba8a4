package main

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/tier/disk"
	"github.com/kvoffload/kvoffload/offload"
	"github.com/kvoffload/kvoffload/offload/hostsim"
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
	cfg.diskFaults = func(op hostsim.DiskFaultOp, dir string) error {
		if op == "fallocate" {
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
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=64k,mode=0700"); err != nil {
		if errors.Is(err, unix.EPERM) {
			t.Skipf("root without CAP_SYS_ADMIN cannot mount a tmpfs: %v", err)
		}
		require.NoError(t, err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, 0) })
	code, out, errs := runCLI(t, tinyDiskArgs(dir, "--disk-bytes", "4MiB")...)
	require.Equal(t, exitError, code, "stdout %s\nstderr %s", out, errs)
	for _, w := range []string{"--disk " + dir, "fallocate", "no space left on device"} {
		require.Contains(t, errs, w)
	}
	require.False(t, strings.Contains(out, "for the next run"))
}

// TestDemoDiskOtherLayout: a demo of another layout on the same --disk
// directory keeps the first layout's records file beside its own, and a
// run of the first layout still loads its first request from disk;
// --disk-remove-records removes only the file it names, and naming this
// layout's own file is refused.
func TestDemoDiskOtherLayout(t *testing.T) {
	dir := t.TempDir()
	tinyFile := filepath.Join(dir, "records-20480.kvo")  // 16 KiB blocks
	bigFile := filepath.Join(dir, "records-2101248.kvo") // 2 MiB blocks (8b)
	require.Equal(t, filepath.Base(tinyFile), filepath.Base(recordsFileOf(t, "tiny")))
	require.Equal(t, filepath.Base(bigFile), filepath.Base(recordsFileOf(t, "8b")))
	tiny := tinyDiskArgs(dir, "--disk-bytes", "64MiB")
	code, out, errs := runCLI(t, tiny...)
	require.Equal(t, exitOK, code, "%s%s", out, errs)
	before, err := os.ReadFile(tinyFile)
	require.NoError(t, err)

	big := []string{"demo", "--backend", "host", "--layout", "8b", "--pool-bytes", "8MiB", "--gpu-blocks", "4",
		"--requests", "3", "--duration", "0", "--pinning", "none", "--disk", dir, "--json"}
	code, out, errs = runCLI(t, big...)
	require.Equal(t, exitOK, code, "%s%s", out, errs)
	after, err := os.ReadFile(tinyFile)
	require.NoError(t, err)
	require.Equal(t, before, after, "the tiny layout's records file is untouched by the 8b run")
	_, err = os.Stat(bigFile)
	require.NoError(t, err)

	code, out, errs = runCLI(t, append(tiny, "--json")...)
	require.Equal(t, exitOK, code, errs)
	var rep demoReport
	require.NoError(t, json.Unmarshal([]byte(out), &rep))
	require.NotNil(t, rep.FirstRequest)
	require.Positive(t, rep.FirstRequest.DiskHits, "the tiny layout's blocks came back from disk after the 8b run")
	require.Zero(t, rep.VerifyFailures)

	code, _, errs = runCLI(t, append(tiny, "--disk-remove-records", filepath.Base(tinyFile))...)
	require.NotEqual(t, exitOK, code)
	require.Contains(t, errs, filepath.Base(tinyFile))
	require.Contains(t, errs, "own records file")
	_, err = os.Stat(tinyFile)
	require.NoError(t, err, "a refused option removes nothing")

	code, _, errs = runCLI(t, append(tiny, "--disk-remove-records", filepath.Base(bigFile))...)
	require.Equal(t, exitOK, code, errs)
	_, err = os.Stat(bigFile)
	require.ErrorIs(t, err, os.ErrNotExist, "the named layout's file is removed")
	_, err = os.Stat(tinyFile)
	require.NoError(t, err)

	code, _, errs = runCLI(t, "demo", "--disk-remove-records", "records-20480.kvo", "--requests", "1", "--duration", "0")
	require.Equal(t, exitUsage, code, errs)
}

// recordsFileOf is the records file name a demo of layout writes.
func recordsFileOf(t *testing.T, layout string) string {
	t.Helper()
	lay := cacheLayout{shape: layoutPresets[layout], kind: offload.LayoutLayerSeparate}
	return filepath.Join("", "records-"+strconv.FormatInt(disk.SlotBytes(lay.blockBytes()), 10)+".kvo")
}
