package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// runCLI runs the command line and returns the exit status and both outputs.
func runCLI(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := run(context.Background(), args, &env{stdout: &out, stderr: &errb})
	return code, out.String(), errb.String()
}

func TestHelp(t *testing.T) {
	code, out, errs := runCLI(t, "--help")
	require.Equal(t, exitOK, code)
	require.Empty(t, errs)
	for _, c := range []string{"demo", "bench", "info"} {
		require.Contains(t, out, c)
	}
	for _, tt := range []struct {
		args []string
		want []string
	}{
		{[]string{"demo", "--help"}, []string{"--pool-bytes", "--gpu-blocks", "--layout", "--backend", "--seed", "--duration", "--requests", "--json", "8b", "1GiB"}},
		{[]string{"demo", "-h"}, []string{"--pool-bytes"}},
		{[]string{"help", "demo"}, []string{"--pool-bytes"}},
		{[]string{"bench", "--help"}, []string{"--out", "--json", "--pool-sizes"}},
		{[]string{"info", "--help"}, []string{"--json", "--device"}},
	} {
		code, out, errs := runCLI(t, tt.args...)
		require.Equal(t, exitOK, code, "%v", tt.args)
		require.Empty(t, errs, "%v", tt.args)
		for _, w := range tt.want {
			require.Contains(t, out, w, "%v", tt.args)
		}
	}
}

func TestUsageErrors(t *testing.T) {
	for _, tt := range []struct {
		args []string
		want string
	}{
		{nil, "Usage"},
		{[]string{"nope"}, `unknown command "nope"`},
		{[]string{"help", "nope"}, `unknown command "nope"`},
		{[]string{"demo", "--no-such-flag"}, "no-such-flag"},
		{[]string{"demo", "--pool-bytes", "1XB"}, `unknown unit "XB"`},
		{[]string{"demo", "--pool-bytes", "12.5"}, "not a whole number"},
		{[]string{"demo", "--layout", "13b"}, `--layout "13b"`},
		{[]string{"demo", "--layout-kind", "paged"}, `--layout-kind "paged"`},
		{[]string{"demo", "--backend", "rocm"}, `--backend "rocm"`},
		{[]string{"demo", "--pinning", "always"}, `--pinning "always"`},
		{[]string{"demo", "--policy", "fifo"}, `--policy "fifo"`},
		{[]string{"demo", "--duration", "-1s"}, "--duration"},
		{[]string{"demo", "--duration", "0"}, "--requests"},
		{[]string{"demo", "--gpu-blocks", "-3"}, "--gpu-blocks -3"},
		{[]string{"demo", "--pool-bytes", "0"}, "--pool-bytes 0"},
		{[]string{"demo", "--pool-bytes", "-1"}, `invalid size "-1": negative; a size is 0 to 256 TiB`},
		{[]string{"soak", "--pool-bytes", "-1"}, `invalid size "-1": negative`},
		{[]string{"bench", "--total-bytes", "-4KiB"}, `invalid size "-4KiB": negative`},
		{[]string{"bench", "--pool-sizes", "1GiB,-1GiB"}, `invalid size "-1GiB": negative`},
		{[]string{"bench", "--seg-sizes", "-1"}, `invalid size "-1": negative`},
		{[]string{"demo", "--prefault-threads", "-2"}, "--prefault-threads -2 must not be negative"},
		{[]string{"soak", "--duration", "-1s"}, "--duration -1s must be positive"},
		{[]string{"soak", "--duration", "0"}, "--duration 0s must be positive"},
		{[]string{"demo", "--layout", "8b", "--pool-bytes", "1MiB"}, "cannot hold one 2 MiB block"},
		{[]string{"demo", "extra"}, `unexpected argument "extra"`},
		{[]string{"info", "--device", "-1"}, "--device -1"},
		{[]string{"bench", "--pool-sizes", "1GiB,huge"}, `"huge"`},
		{[]string{"bench", "--seg-sizes", ""}, "seg-sizes"},
	} {
		code, _, errs := runCLI(t, tt.args...)
		require.Equal(t, exitUsage, code, "%v: %s", tt.args, errs)
		require.Contains(t, errs, tt.want, "%v", tt.args)
	}
}

func TestExitStatuses(t *testing.T) {
	for _, tt := range []struct {
		err  error
		code int
	}{
		{nil, exitOK},
		{errors.New("boom"), exitError},
		{errVerification, exitVerify},
		{errUsage, exitUsage},
	} {
		commands["test-exit"] = command{name: "test-exit", flags: func(*flag.FlagSet) func(context.Context, *env, []string) error {
			return func(context.Context, *env, []string) error { return tt.err }
		}}
		code, _, errs := runCLI(t, "test-exit")
		require.Equal(t, tt.code, code)
		if tt.err != nil {
			require.Contains(t, errs, tt.err.Error())
		}
	}
	delete(commands, "test-exit")
}
