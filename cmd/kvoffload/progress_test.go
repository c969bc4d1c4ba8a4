package main

import (
	"bytes"
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// lockedBuffer is a bytes.Buffer safe for the spinner's goroutine.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func TestStepProgress(t *testing.T) {
	old := stepDelay
	t.Cleanup(func() { stepDelay = old })

	// No writer (not a terminal, or --json): nothing, and end returns.
	startStep(nil, "x").end()

	// A step shorter than the delay prints nothing.
	stepDelay = time.Hour
	var short lockedBuffer
	s := startStep(&short, "short step")
	time.Sleep(20 * time.Millisecond)
	s.end()
	s.end()
	require.Empty(t, short.String())

	// A longer one shows its description, then clears its line.
	stepDelay = 10 * time.Millisecond
	var long lockedBuffer
	s = startStep(&long, "measuring throughput")
	require.Eventually(t, func() bool { return strings.Contains(long.String(), "measuring throughput") },
		5*time.Second, 10*time.Millisecond)
	s.end()
	out := long.String()
	require.True(t, strings.HasSuffix(out, "\r"), "the spinner's line is cleared at the end: %q", out[max(0, len(out)-40):])
	n := len(out)
	time.Sleep(150 * time.Millisecond)
	require.Equal(t, n, len(long.String()), "nothing is written after end")
}

// Without a terminal the demo writes nothing but its report to stdout and
// its notices to stderr: no progress output.
func TestDemoNoProgressWithoutTTY(t *testing.T) {
	old := stepDelay
	t.Cleanup(func() { stepDelay = old })
	stepDelay = 0
	code, _, errs := runCLI(t, "demo", "--backend", "host", "--layout", "tiny", "--pool-bytes", "1MiB", "--requests", "20", "--duration", "0")
	require.Equal(t, exitOK, code, errs)
	require.NotContains(t, errs, "\r")
}

// On a terminal the demo shows a spinner on the engine's start and close
// (here at once: stepDelay 0) and the serving bar.
func TestDemoProgressOnTTY(t *testing.T) {
	old := stepDelay
	t.Cleanup(func() { stepDelay = old })
	stepDelay = 0
	var progress lockedBuffer
	cfg := defaultDemoConfig()
	cfg.backend, cfg.layoutName, cfg.poolBytes, cfg.requests, cfg.duration = "host", "tiny", 1<<20, 50, 0
	rep, err := runDemo(context.Background(), cfg, &progress, func(string) {})
	require.NoError(t, err)
	require.Equal(t, 50, rep.Requests)
	out := progress.String()
	require.Contains(t, out, "starting the engine (1 MiB pool, host backend)")
	require.Contains(t, out, "closing the engine")
}
