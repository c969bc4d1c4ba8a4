package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"os"
	"os/exec"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// TestMain runs the tests, or, in a child started by startCLI
// (KVO_TEST_CLI=1), the command line itself.
func TestMain(m *testing.M) {
	if os.Getenv("KVO_TEST_CLI") == "1" {
		main() // the command line is os.Args[1:]
		return
	}
	// go-zeromq/zmq4 v0.17.0's PUB socket starts a writer goroutine
	// (pubMWriter.run) that its Close never stops: one per socket, the
	// library's leak, not ours (--events closes its socket).
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}

// startCLI starts the command line in a child process (this test binary
// running main).
func startCLI(t *testing.T, args ...string) (cmd *exec.Cmd, stdout, stderr *bytes.Buffer) {
	t.Helper()
	cmd = exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), "KVO_TEST_CLI=1")
	stdout, stderr = &bytes.Buffer{}, &bytes.Buffer{}
	cmd.Stdout, cmd.Stderr = stdout, stderr
	require.NoError(t, cmd.Start())
	return cmd, stdout, stderr
}

// TestInterruptedBySignal: SIGINT or SIGTERM during demo or soak ends it
// soon, with the report of what ran marked interrupted and the exit
// status a shell gives a process the signal ended (130, 143).
func TestInterruptedBySignal(t *testing.T) {
	demo := []string{"demo", "--backend", "host", "--layout", "tiny", "--pool-bytes", "16MiB", "--gpu-blocks", "64",
		"--pinning", "none", "--duration", "1m"}
	soak := []string{"soak", "--backend", "host", "--pool-bytes", "16MiB", "--duration", "1m"}
	for _, tt := range []struct {
		name string
		args []string
		sig  syscall.Signal
		code int
	}{
		{"demo-int-json", append(demo, "--json"), syscall.SIGINT, 130},
		{"demo-term-json", append(demo, "--json"), syscall.SIGTERM, 143},
		{"demo-int-text", demo, syscall.SIGINT, 130},
		{"soak-term-json", append(soak, "--json"), syscall.SIGTERM, 143},
		{"soak-int-text", soak, syscall.SIGINT, 130},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cmd, stdout, stderr := startCLI(t, tt.args...)
			time.Sleep(time.Second) // serving by now
			require.NoError(t, cmd.Process.Signal(tt.sig))
			sent := time.Now()
			exited := make(chan error, 1)
			go func() { exited <- cmd.Wait() }()
			select {
			case <-exited:
			case <-time.After(10 * time.Second):
				require.NoError(t, cmd.Process.Kill())
				<-exited
				require.Fail(t, "still running 10 s after the signal", "stderr: %s", stderr)
			}
			require.Less(t, time.Since(sent), 3*time.Second, "stopped soon after the signal")
			require.Equal(t, tt.code, cmd.ProcessState.ExitCode(), "stderr: %s", stderr)
			out := stdout.String()
			if !slices.Contains(tt.args, "--json") {
				require.Contains(t, out, "interrupted")
				return
			}
			var rep struct {
				Interrupted bool  `json:"interrupted"`
				Requests    int64 `json:"requests"`
			}
			require.NoError(t, json.Unmarshal([]byte(out), &rep), out)
			require.True(t, rep.Interrupted, out)
			require.Positive(t, rep.Requests, "it served before the signal")
		})
	}
}

// TestInterruptedStatus: run gives the interrupting signal's status, and a
// verification failure's status over it.
func TestInterruptedStatus(t *testing.T) {
	ctx, cancel := context.WithCancelCause(context.Background())
	cancel(interruption{syscall.SIGTERM})
	var out, errb bytes.Buffer
	code := run(ctx, []string{"demo", "--json", "--backend", "host", "--layout", "tiny", "--pool-bytes", "1MiB",
		"--gpu-blocks", "32", "--pinning", "none"}, &env{stdout: &out, stderr: &errb})
	require.Equal(t, 143, code, errb.String())
	var rep demoReport
	require.NoError(t, json.Unmarshal(out.Bytes(), &rep))
	require.True(t, rep.Interrupted)

	for _, tt := range []struct {
		err  error
		code int
	}{{nil, 130}, {errors.New("boom"), 130}, {errVerification, exitVerify}} {
		commands["test-exit"] = command{name: "test-exit", flags: func(*flag.FlagSet) func(context.Context, *env, []string) error {
			return func(context.Context, *env, []string) error { return tt.err }
		}}
		ctx, cancel := context.WithCancelCause(context.Background())
		cancel(interruption{syscall.SIGINT})
		require.Equal(t, tt.code, run(ctx, []string{"test-exit"}, &env{stdout: &out, stderr: &errb}), "%v", tt.err)
	}
	delete(commands, "test-exit")
}

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
