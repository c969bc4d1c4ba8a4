package main

import (
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestEventsRaceABI compiles test/events_race.c against kvoffload.h and
// the library and runs it: the event calls on several pthreads racing
// kvo_events_close and kvo_engine_destroy, through the C ABI, never fail
// otherwise than as documented and every destroy succeeds
// (TestEventsRaceDestroy is the same race in Go, under -race).
func TestEventsRaceABI(t *testing.T) {
	dir := buildLib(t)
	exe := filepath.Join(t.TempDir(), "events_race")
	out, err := exec.Command("gcc", "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror", "-O1",
		"-I.", "-o", exe, "test/events_race.c", "-L"+dir, "-lkvoffload", "-Wl,-rpath,"+dir, "-lpthread").CombinedOutput()
	require.NoError(t, err, "gcc: %s", out)
	out, err = exec.Command(exe).CombinedOutput()
	require.NoError(t, err, "events_race: %s", out)
	require.Contains(t, string(out), "events_race: ok")
	t.Logf("%s", out)
}
