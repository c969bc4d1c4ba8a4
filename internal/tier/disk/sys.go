package disk

import (
	"errors"
	"fmt"
	"io"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// align is the alignment of every O_DIRECT offset, length and buffer here:
// 4 KiB covers both 512-byte and 4 KiB logical blocks.
const align = 4096

// AlignedBuffer returns n bytes starting at a 4 KiB-aligned address: a
// buffer Put and Get take with O_DIRECT as it is when n is a multiple of
// 4 KiB (the engine's and the node's copy buffers for write-backs).
func AlignedBuffer(n int) []byte { return alignedBuf(n) }

// alignedBuf returns n bytes (n a multiple of align) starting at an
// align-aligned address. Go's heap does not move objects, so the address
// stays valid for the slice's life.
func alignedBuf(n int) []byte {
	b := make([]byte, n+align)
	off := 0
	if r := int(uintptr(unsafe.Pointer(&b[0])) % align); r != 0 {
		off = align - r
	}
	return b[off : off+n : off+n]
}

// isAligned reports whether b starts at an align-aligned address and its
// length is a multiple of align: what O_DIRECT needs of a buffer.
func isAligned(b []byte) bool {
	return len(b) > 0 && len(b)%align == 0 && uintptr(unsafe.Pointer(&b[0]))%align == 0
}

func roundUp(n, a int64) int64 { return (n + a - 1) / a * a }

// pwriteFull writes every buffer of bufs, in order, from off, retrying
// short writes and EINTR.
func pwriteFull(fd int, bufs [][]byte, off int64) error {
	return ioFull(fd, bufs, off, true)
}

// preadFull fills every buffer of bufs, in order, from off. Reading past the
// end of the file is io.ErrUnexpectedEOF.
func preadFull(fd int, bufs [][]byte, off int64) error {
	return ioFull(fd, bufs, off, false)
}

// ioFull is one preadv/pwritev, then preads/pwrites for whatever a short
// transfer left.
func ioFull(fd int, bufs [][]byte, off int64, write bool) error {
	vec, one := unix.Preadv, unix.Pread
	if write {
		vec, one = unix.Pwritev, unix.Pwrite
	}
	n, err := vec(fd, bufs, off)
	for err == unix.EINTR {
		n, err = vec(fd, bufs, off)
	}
	if err != nil {
		return err
	}
	for _, b := range bufs {
		if n >= len(b) {
			n -= len(b)
			off += int64(len(b))
			continue
		}
		b, off = b[n:], off+int64(n)
		n = 0
		for len(b) > 0 {
			m, err := one(fd, b, off)
			if err == unix.EINTR {
				continue
			}
			if err != nil {
				return err
			}
			if m == 0 {
				if write {
					return io.ErrShortWrite
				}
				return io.ErrUnexpectedEOF
			}
			b, off = b[m:], off+int64(m)
		}
	}
	return nil
}

// bouncePool hands out at most n aligned buffers of size bytes, allocated on
// first use; get waits while all are out. It serves only callers whose
// buffers O_DIRECT cannot use as they are.
type bouncePool struct {
	size   int
	tokens chan struct{}
	mu     sync.Mutex
	bufs   [][]byte
}

func newBouncePool(size, n int) *bouncePool {
	p := &bouncePool{size: size, tokens: make(chan struct{}, n)}
	for range n {
		p.tokens <- struct{}{}
	}
	return p
}

func (p *bouncePool) get() []byte {
	<-p.tokens
	p.mu.Lock()
	defer p.mu.Unlock()
	if k := len(p.bufs); k > 0 {
		b := p.bufs[k-1]
		p.bufs = p.bufs[:k-1]
		return b
	}
	return alignedBuf(p.size)
}

func (p *bouncePool) put(b []byte) {
	p.mu.Lock()
	p.bufs = append(p.bufs, b)
	p.mu.Unlock()
	p.tokens <- struct{}{}
}

// headerBufs holds aligned header sectors for the I/O paths.
var headerBufs = sync.Pool{New: func() any { b := alignedBuf(align); return &b }}

// isNoSpace reports ENOSPC or EDQUOT.
func isNoSpace(err error) bool {
	return errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT)
}

// isReadOnly reports the errors a directory or file system that refuses
// writes gives.
func isReadOnly(err error) bool {
	return errors.Is(err, unix.EROFS) || errors.Is(err, unix.EACCES) || errors.Is(err, unix.EPERM)
}

// opError names the operation and the file in an I/O error.
func opError(op, path string, err error) error {
	return fmt.Errorf("disk: %s %s: %w", op, path, err)
}
