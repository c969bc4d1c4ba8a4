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
// looked up, planned, submitted, returned) and then the submitting
// thread's for its op (issued, each part built and copied, layer 0's
// events recorded: "layer0"), and the entry's CLOCK_MONOTONIC time (what
// Python's time.monotonic_ns() reads: a caller there can tell its own
// share). A diagnostic for where a call's time goes on a machine without
// a profiler (the Python call through the C ABI); one call is traced at a
// time (a call that starts while another is traced is not), and the
// engine's test hooks, when they trace, take precedence.
const traceCallsEnv = "KVOFFLOAD_TRACE_CALLS"

// callTracer is traceCallsEnv's tracer: point is the engine's tracePoint
// and the scheduler's Config.Trace.
type callTracer struct {
	mu   sync.Mutex
	w    io.Writer
	left int  // calls still to trace
	on   bool // a call is traced (its line not written yet)
	// ret: the call returned (after returned, with err); submitted: it
	// submitted an op; issued: the op's first layer (or batch) is enqueued.
	ret, submitted, issued bool
	returned               time.Duration
	err                    error
	t0                     time.Time
	mono                   int64 // CLOCK_MONOTONIC at t0, ns: Python's time.monotonic_ns()
	kind                   string
	n                      int
	names                  []string
	at                     []time.Duration
}

func newCallTracer(w io.Writer, calls int) *callTracer {
	return &callTracer{w: w, left: calls}
}

// begin starts tracing a call of kind over n blocks, unless one is traced
// or the budget is spent; it returns whether it did (then end must follow).
// A line still waiting for its op's issue (see end) is written first.
func (t *callTracer) begin(kind string, n int) bool {
	if t == nil {
		return false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.on && t.ret {
		t.writeLocked()
	}
	if t.on || t.left <= 0 {
		return false
	}
	t.left--
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	t.on, t.ret, t.issued, t.submitted = true, false, false, false
	t.t0, t.kind, t.n, t.mono, t.err = time.Now(), kind, n, ts.Nano(), nil
	t.names, t.at = t.names[:0], t.at[:0]
	return true
}

// point notes a point of the traced call (part >= 0: of that part). The
// scheduler's points go on after the call returned, until its op's first
// layer is enqueued ("layer0") or its batch is ("issued"): then the line
// is written.
func (t *callTracer) point(name string, part int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.on {
		return
	}
	switch {
	case name == "submit":
		t.submitted = true
	case name == "issued" || name == "layer" && part == 0:
		t.issued = true
	}
	if len(t.names) < 64 {
		label := name
		if part >= 0 {
			label = fmt.Sprintf("%s%d", name, part)
		}
		t.names, t.at = append(t.names, label), append(t.at, time.Since(t.t0))
	}
	if t.ret && t.issued {
		t.writeLocked()
	}
}

// end notes that the traced call returned (with err). Its line is written
// now, unless the call submitted an op whose first layer is not enqueued
// yet: then at that point, so that the line shows the submitting thread's
// work after the return too.
func (t *callTracer) end(err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.ret, t.returned, t.err = true, time.Since(t.t0), err
	if len(t.names) < 64 {
		t.names, t.at = append(t.names, "returned"), append(t.at, t.returned)
	}
	if err != nil || !t.submitted || t.issued {
		t.writeLocked()
	}
}

// writeLocked writes the traced call's line and ends the trace.
func (t *callTracer) writeLocked() {
	t.on = false
	var sb strings.Builder
	fmt.Fprintf(&sb, "kvoffload trace: %s of %d blocks entered at %d ns (CLOCK_MONOTONIC), returned after %.3f ms", t.kind, t.n, t.mono, msOf(t.returned))
	if t.err != nil {
		fmt.Fprintf(&sb, " (error: %v)", t.err)
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
