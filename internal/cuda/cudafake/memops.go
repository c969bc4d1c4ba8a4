package cudafake

import "github.com/kvoffload/kvoffload/internal/cuda"

// Host functions on streams (cuLaunchHostFunc) and direct access to the
// fake's memory.

// LaunchHostFunc enqueues fn on s, like cuLaunchHostFunc: it runs on the
// stream's goroutine once the work before it has, and the work after it
// waits for it to return (a test's "kernel", or a gate that holds the
// stream). fn must not call the driver.
func (d *Driver) LaunchHostFunc(s cuda.Stream, fn func()) error {
	const op = "cuLaunchHostFunc"
	d.mu.Lock()
	defer d.mu.Unlock()
	call, err := d.beginLocked(op, needCtx)
	if err != nil {
		return err
	}
	st, err := d.streamLocked(op, s)
	if err != nil {
		return err
	}
	return d.enqueueLocked(op, call, st, item{kind: itemHost, host: fn})
}

// Bytes returns the n bytes of known memory (device, host-allocated or
// registered) at addr, or false when they are not inside one allocation.
// The caller orders its accesses with the streams that use them.
func (d *Driver) Bytes(addr, n uint64) ([]byte, bool) {
	d.mem.mu.RLock()
	defer d.mem.mu.RUnlock()
	return d.mem.slice(addr, n)
}
