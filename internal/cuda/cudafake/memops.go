package cudafake

import (
	"encoding/binary"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

// Stream memory operations (cuStreamWaitValue64, cuStreamWriteValue64) on
// 64-bit words of device memory. The fake reads and writes the words under
// the driver's lock, so a wait sees a write as soon as the writing stream
// reaches it; a word must not also be written by copies or kernels.

// SetStreamMemOps sets what HasStreamMemOps reports.
func (d *Driver) SetStreamMemOps(ok bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.hasMemOps = ok
}

// HasStreamMemOps implements cuda.Driver.
func (d *Driver) HasStreamMemOps() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.hasMemOps
}

// StreamWaitValue64 implements cuda.Driver (GEQ only, as the engine uses).
func (d *Driver) StreamWaitValue64(s cuda.Stream, addr cuda.DevicePtr, value uint64, flags uint32) error {
	return d.memOp(cuda.OpStreamWaitValue64, itemWaitValue, s, addr, value, flags)
}

// StreamWriteValue64 implements cuda.Driver.
func (d *Driver) StreamWriteValue64(s cuda.Stream, addr cuda.DevicePtr, value uint64, flags uint32) error {
	return d.memOp(cuda.OpStreamWriteValue64, itemWriteValue, s, addr, value, flags)
}

func (d *Driver) memOp(op string, kind itemKind, s cuda.Stream, addr cuda.DevicePtr, value uint64, flags uint32) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	call, err := d.beginLocked(op, needCtx)
	if err != nil {
		return err
	}
	if !d.hasMemOps {
		return cuda.NewError(op, cuda.ErrorNotSupported)
	}
	if flags != 0 || addr%8 != 0 || !d.mem.valid(uint64(addr), 8) {
		return cuda.NewError(op, cuda.ErrorInvalidValue)
	}
	st, err := d.streamLocked(op, s)
	if err != nil {
		return err
	}
	if st.capture != nil {
		return cuda.NewError(op, cuda.ErrorStreamCaptureUnsupported)
	}
	return d.enqueueLocked(op, call, st, item{kind: kind, dst: uint64(addr), n: value})
}

// wordLocked reads the 64-bit word at addr (0 if it is no longer mapped).
func (d *Driver) wordLocked(addr uint64) uint64 {
	d.mem.mu.RLock()
	defer d.mem.mu.RUnlock()
	b, ok := d.mem.slice(addr, 8)
	if !ok {
		return 0
	}
	return binary.LittleEndian.Uint64(b)
}

func (d *Driver) setWordLocked(addr, v uint64) {
	d.mem.mu.RLock()
	defer d.mem.mu.RUnlock()
	if b, ok := d.mem.slice(addr, 8); ok {
		binary.LittleEndian.PutUint64(b, v)
	}
}

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
