package main

import (
	"bytes"
	"context"
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
