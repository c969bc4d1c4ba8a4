package main

import (
	"bytes"
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/offload"
)

func TestSoakShort(t *testing.T) {
	res, err := runSoak(context.Background(), soakConfig{duration: 3 * time.Second, backend: offload.BackendHost, seed: 3,
		poolBytes: 16 << 20, layout: "tiny"}, &bytes.Buffer{})
	require.NoError(t, err)
	require.Positive(t, res.Engines)
	require.Positive(t, res.BlocksVerified)
	require.Zero(t, res.Errors)
	var out bytes.Buffer
	require.NoError(t, res.print(&out, false))
	require.Contains(t, out.String(), "blocks verified")
}

func TestSoakBadDuration(t *testing.T) {
	_, err := runSoak(context.Background(), soakConfig{backend: offload.BackendHost}, &bytes.Buffer{})
	require.ErrorIs(t, err, errUsage)
}

// TestVerificationErrorHasNoBlockData: the error and report of a demo whose
// verification caught a wrong block name the block id and key, never the
// block's bytes (KV blocks are users' prompts).
func TestVerificationErrorHasNoBlockData(t *testing.T) {
	cfg := tinyDemo(offload.BackendHost)
	cfg.corruptLoads = 2
	rep, err := runDemo(context.Background(), cfg, nil, noNotice)
	require.ErrorIs(t, err, errVerification)
	var out bytes.Buffer
	require.NoError(t, rep.print(&out))
	text := err.Error() + "\n" + out.String() + "\n" + rep.FirstFailure
	// No hex run longer than a key (32 digits), no run of raw bytes.
	require.NotRegexp(t, `[0-9a-fA-F]{33,}`, text)
	require.NotRegexp(t, `(?:[0-9a-fA-F]{2}[ ,]){8,}`, text)
	require.NotRegexp(t, `[\x00-\x08\x0e-\x1f\x7f-\x9f]`, text)
}

// TestSoakBadFlags: the soak checks its flags once, as the demo does, and
// exits with status 2 at once instead of failing a round each time for the
// whole duration.
func TestSoakBadFlags(t *testing.T) {
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"--pool-bytes", "0"}, "--pool-bytes 0 must be positive"},
		{[]string{"--layout", "13b"}, `--layout "13b"`},
		{[]string{"--backend", "rocm"}, `--backend "rocm"`},
		{[]string{"--layout", "70b", "--pool-bytes", "4MiB"}, "cannot hold one 5 MiB block"},
	} {
		t0 := time.Now()
		code, out, errs := runCLI(t, append([]string{"soak", "--duration", "1m"}, tt.args...)...)
		require.Equal(t, exitUsage, code, "%v: %s", tt.args, errs)
		require.Contains(t, errs, tt.want, "%v", tt.args)
		require.Empty(t, out, "%v: no report", tt.args)
		require.Less(t, time.Since(t0), 2*time.Second, "%v", tt.args)
	}
}

// TestSoakStopsOnRepeatedError: rounds that fail the same way every time
// (here: no CUDA driver) stop the soak with that error.
func TestSoakStopsOnRepeatedError(t *testing.T) {
	if _, err := defaultProber().load(); err == nil {
		t.Skip("a CUDA driver is present")
	}
	t0 := time.Now()
	code, out, errs := runCLI(t, "soak", "--backend", "cuda", "--duration", "1m", "--json")
	require.Equal(t, exitError, code)
	require.Less(t, time.Since(t0), 5*time.Second)
	require.Contains(t, errs, "stopped after 3 rounds in a row failed with the same error")
	require.Contains(t, errs, "driver not available")
	var res soakResult
	require.NoError(t, json.Unmarshal([]byte(out), &res))
	require.Equal(t, 3, res.Engines)
}

// TestSoakRegionHoldsABlock: a pool whose eighth is smaller than one block
// still runs (its regions hold one block each).
func TestSoakRegionHoldsABlock(t *testing.T) {
	res, err := runSoak(context.Background(), soakConfig{duration: time.Second, backend: offload.BackendHost, seed: 5,
		poolBytes: 8 << 20, layout: "70b"}, &bytes.Buffer{})
	require.NoError(t, err)
	require.Zero(t, res.Errors, res.FirstError)
}
