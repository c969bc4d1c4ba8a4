package offload

import "fmt"

// Staging is a pinned host buffer, at an address fixed until Close.
type Staging struct {
	name string
	addr uintptr
	dev  uint64
	size int64
	buf  []byte
}

// length is the buffer's size in bytes, exactly as asked.
func (s *Staging) length() int64 { return s.size }

// Addr is the buffer's host address.
func (s *Staging) Addr() uintptr { return s.addr }

// DevicePtr is the address kernels and copies use (Addr on the host
// backend).
func (s *Staging) DevicePtr() uint64 { return s.dev }

// Bytes is the buffer's memory. It must not be used after Close.
func (s *Staging) Bytes() []byte { return s.buf }

// Staging returns the staging region's buffer name, of exactly bytes bytes.
func (e *Engine) Staging(name string, bytes int64) (*Staging, error) {
	if err := e.checkOpen("Staging"); err != nil {
		return nil, err
	}
	return e.staging(name, bytes)
}

func (e *Engine) staging(name string, bytes int64) (*Staging, error) {
	if bytes <= 0 {
		return nil, fmt.Errorf("%w: Staging %q of %d bytes: must be at least 1", ErrInvalidArgument, name, bytes)
	}
	e.memory.mu.Lock()
	defer e.memory.mu.Unlock()
	if s, ok := e.stage.buffers[name]; ok {
		if s.size != bytes {
			return nil, fmt.Errorf("%w: Staging %q exists with %d bytes, asked for %d", ErrInvalidArgument, name, s.size, bytes)
		}
		return s, nil
	}
	if e.stage.region == nil {
		return nil, fmt.Errorf("%w: Staging %q: no staging region (Config.StagingBytes < 0)", ErrInsufficientMemory, name)
	}
	off := (e.stage.used + stagingAlign - 1) / stagingAlign * stagingAlign
	total := e.stage.region.r.Len()
	if off+bytes > total {
		return nil, fmt.Errorf("%w: Staging %q of %d bytes: %d of %d staging bytes left (raise Config.StagingBytes)", ErrInsufficientMemory, name, bytes, total-off, total)
	}
	buf := e.stage.region.r.Bytes()[off : off+bytes : off+bytes]
	addr := e.stage.region.r.Addr() + uintptr(off)
	s := &Staging{name: name, addr: addr, dev: e.stage.dev + uint64(off), size: bytes, buf: buf}
	e.stage.buffers[name] = s
	e.stage.used = off + bytes
	return s, nil
}

// stagingDevicePtr is the device address of the staging region's first
// byte: its registered host pointer as the GPU sees it.
func (e *Engine) stagingDevicePtr(pr *poolRegion) (uint64, error) {
	if e.gpu == nil {
		return pr.host, nil
	}
	p, err := e.gpu.HostDevicePointer(pr.r.Pointer())
	if err != nil {
		return 0, fmt.Errorf("offload: staging region's device pointer: %w", err)
	}
	return p, nil
}

// stagingAlign is the alignment of staging buffers (a GPU cache line).
const stagingAlign = 256
