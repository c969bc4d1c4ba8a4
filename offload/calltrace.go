package offload

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// traceCallsEnv, when set to N > 0, makes the engine write one line to
// stderr for each of its first N Store and Load calls: the wall-clock
// times, from the call's entry, at which it reached its points (checked,
// looked up, planned, the scheduler's promise, the head's parts built and
// copied, returned), and the entry's CLOCK_MONOTONIC time (what Python's
// time.monotonic_ns() reads: a caller there can tell its own share). A
// diagnostic for where a call's time goes on a
// machine without a profiler (the Python call through the C ABI); one call
// is traced at a time (a call that starts while another is traced is not),
// and the engine's test hooks, when they trace, take precedence.
const traceCallsEnv = "KVOFFLOAD_TRACE_CALLS"

// callTracer is traceCallsEnv's tracer: point is the engine's tracePoint
// and the scheduler's Config.Trace.
type callTracer struct {
	mu    sync.Mutex
	w     io.Writer
	left  int // calls still to trace
	on    bool
	t0    time.Time
	mono  int64 // CLOCK_MONOTONIC at t0, ns: Python's time.monotonic_ns()
	kind  string
	n     int
	names []string
	at    []time.Duration
}

func newCallTracer(w io.Writer, calls int) *callTracer {
	return &callTracer{w: w, left: calls}
}

// begin starts tracing a call of kind over n blocks, unless one is traced
// or the budget is spent; it returns whether it did (then end must follow).
func (t *callTracer) begin(kind string, n int) bool {
	if t == nil {
		return false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.on || t.left <= 0 {
		return false
	}
	t.left--
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	t.on, t.t0, t.kind, t.n, t.mono = true, time.Now(), kind, n, ts.Nano()
	t.names, t.at = t.names[:0], t.at[:0]
	return true
}

// point notes a point of the traced call (part >= 0: of that part).
func (t *callTracer) point(name string, part int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.on || len(t.names) >= 64 {
		return
	}
	if part >= 0 {
		name = fmt.Sprintf("%s%d", name, part)
	}
	t.names, t.at = append(t.names, name), append(t.at, time.Since(t.t0))
}

// end ends the traced call and writes its line.
func (t *callTracer) end(err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	total := time.Since(t.t0)
	t.on = false
	var sb strings.Builder
	fmt.Fprintf(&sb, "kvoffload trace: %s of %d blocks entered at %d ns (CLOCK_MONOTONIC), returned after %.3f ms", t.kind, t.n, t.mono, msOf(total))
	if err != nil {
		fmt.Fprintf(&sb, " (error: %v)", err)
	}
	sb.WriteString(":")
	for i, name := range t.names {
		fmt.Fprintf(&sb, " %s %.3f", name, msOf(t.at[i]))
	}
	sb.WriteString(" (ms from the call's entry)\n")
	_, _ = io.WriteString(t.w, sb.String())
}

func msOf(d time.Duration) float64 { return d.Seconds() * 1e3 }

// traceCallsFromEnv reads traceCallsEnv: nil when unset or 0.
func traceCallsFromEnv() (*callTracer, error) {
	n, err := envInt(traceCallsEnv, 0, 0, 1<<20, "calls")
	if err != nil || n == 0 {
		return nil, err
	}
	return newCallTracer(os.Stderr, n), nil
}
