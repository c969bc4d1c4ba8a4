package wire

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Conn is one end of a node connection: a SOCK_SEQPACKET unix socket
// carrying one message per packet. Send may be called from several
// goroutines (each message is one sendmsg, atomic on a packet socket);
// Recv from one goroutine at a time.
type Conn struct {
	uc   *net.UnixConn
	rc   syscall.RawConn // uc's, for recvmsg without a source address
	rbuf []byte
	oob  []byte
	rs   recvState
	// tryRecv bound once: a method value made per read would be allocated.
	tryRecv func(fd uintptr) bool

	wmu  sync.Mutex
	wbuf []byte
}

// NewConn wraps a connected "unixpacket" socket and sizes its buffers so
// that a message of MaxMessage bytes fits in one packet.
func NewConn(uc *net.UnixConn) *Conn {
	_ = uc.SetWriteBuffer(4 * MaxMessage)
	_ = uc.SetReadBuffer(4 * MaxMessage)
	c := &Conn{uc: uc, rbuf: make([]byte, MaxMessage+1), oob: make([]byte, unix.CmsgSpace(4*4)), wbuf: make([]byte, 0, 4096)}
	c.rc, _ = uc.SyscallConn() // nil only for a nil socket: Recv falls back to ReadMsgUnix
	c.tryRecv = c.tryRecvOnce
	return c
}

// NewConnSize is NewConn receiving messages of at most recv bytes (a
// longer one is refused as truncated, ErrMalformed) until SetRecvSize: a
// server keeps a connection that has not said Hello small. recv 0: no
// receive buffer (the connection only sends).
func NewConnSize(uc *net.UnixConn, recv int) *Conn {
	c := &Conn{uc: uc, rbuf: make([]byte, min(max(recv, 1), MaxMessage+1)), oob: make([]byte, unix.CmsgSpace(4*4))}
	c.rc, _ = uc.SyscallConn()
	c.tryRecv = c.tryRecvOnce
	return c
}

// SetRecvSize lets Recv take messages of up to MaxMessage bytes, and sizes
// the socket's buffers as NewConn does. Not concurrently with Recv.
func (c *Conn) SetRecvSize() {
	if len(c.rbuf) <= MaxMessage {
		_ = c.uc.SetWriteBuffer(4 * MaxMessage)
		_ = c.uc.SetReadBuffer(4 * MaxMessage)
		c.rbuf = make([]byte, MaxMessage+1)
	}
}

// UnixConn is the socket.
func (c *Conn) UnixConn() *net.UnixConn { return c.uc }

// Close closes the socket.
func (c *Conn) Close() error { return c.uc.Close() }

// Send encodes m and sends it, with fd attached (SCM_RIGHTS) when fd >= 0.
func (c *Conn) Send(m *Msg, fd int) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	b, err := Encode(c.wbuf[:0], m)
	if err != nil {
		return err
	}
	c.wbuf = b[:0]
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	n, _, err := c.uc.WriteMsgUnix(b, oob, nil)
	if err != nil {
		return err
	}
	if n != len(b) {
		return fmt.Errorf("wire: short write of %v: %d of %d bytes", m.Type, n, len(b))
	}
	return nil
}

// Recv receives and decodes one message into m. A file descriptor that came
// with it is returned (else -1) and is the caller's to close; a message
// that carried more than one, or a truncated one, is an error wrapping
// ErrMalformed after every descriptor received was closed. The peer
// closing the connection is io.EOF. A message that does not decode is an
// error wrapping ErrMalformed; the connection stays usable (the next
// packet is the next message).
func (c *Conn) Recv(m *Msg) (fd int, err error) {
	n, oobn, flags, err := c.recvmsg()
	fds := parseRights(c.oob[:oobn])
	fd = -1
	bad := func(e error) (int, error) {
		for _, f := range fds {
			_ = unix.Close(f)
		}
		return -1, e
	}
	if err != nil {
		return bad(err)
	}
	if n == 0 && oobn == 0 {
		return bad(io.EOF) // a packet socket reads 0 bytes only at the peer's close
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 || n > MaxMessage {
		return bad(fmt.Errorf("%w: truncated packet (%d bytes, flags %#x)", ErrMalformed, n, flags))
	}
	if len(fds) > 1 {
		return bad(fmt.Errorf("%w: %d file descriptors on one message", ErrMalformed, len(fds)))
	}
	if err := Decode(c.rbuf[:n], m); err != nil {
		return bad(err)
	}
	if len(fds) == 1 {
		fd = fds[0]
	}
	return fd, nil
}

// recvmsg reads one packet into c.rbuf and its control messages into
// c.oob, waiting in the runtime's poller (the socket's read deadline
// applies, and Close ends the wait with net.ErrClosed) as ReadMsgUnix
// does, but without asking for the sender's address, which ReadMsgUnix
// allocates (three objects a message) on every read. Its state lives in
// c (Recv has one caller at a time), so that a read allocates nothing.
func (c *Conn) recvmsg() (n, oobn, flags int, err error) {
	if c.rc == nil {
		n, oobn, flags, _, err = c.uc.ReadMsgUnix(c.rbuf, c.oob)
		return n, oobn, flags, err
	}
	r := &c.rs
	r.n, r.oobn, r.flags, r.err = 0, 0, 0, nil
	err = c.rc.Read(c.tryRecv)
	if err == nil {
		err = r.err
	}
	if err != nil {
		return 0, 0, 0, &net.OpError{Op: "read", Net: "unixpacket", Source: c.uc.LocalAddr(), Addr: c.uc.RemoteAddr(), Err: err}
	}
	return r.n, r.oobn, r.flags, nil
}

// recvState is one recvmsg's: its buffers' descriptors and its results.
type recvState struct {
	iov            unix.Iovec
	msg            unix.Msghdr
	n, oobn, flags int
	err            error
}

// tryRecvOnce is recvmsg's attempt on the socket (c.rc.Read's callback): false
// when nothing is there yet (EAGAIN: wait for the socket to turn readable).
func (c *Conn) tryRecvOnce(fd uintptr) bool {
	r := &c.rs
	r.iov = unix.Iovec{Base: &c.rbuf[0]}
	r.iov.SetLen(len(c.rbuf))
	r.msg = unix.Msghdr{Iov: &r.iov, Iovlen: 1, Control: &c.oob[0]}
	r.msg.SetControllen(len(c.oob))
	n, _, e := unix.Syscall(unix.SYS_RECVMSG, fd, uintptr(unsafe.Pointer(&r.msg)), unix.MSG_CMSG_CLOEXEC)
	switch e {
	case 0:
		r.n, r.oobn, r.flags = int(n), int(r.msg.Controllen), int(r.msg.Flags)
	case unix.EAGAIN:
		return false
	default:
		r.err = os.NewSyscallError("recvmsg", e)
	}
	return true
}

func parseRights(oob []byte) []int {
	if len(oob) == 0 {
		return nil
	}
	cmsgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil
	}
	var fds []int
	for i := range cmsgs {
		if f, err := unix.ParseUnixRights(&cmsgs[i]); err == nil {
			fds = append(fds, f...)
		}
	}
	return fds
}

// IsClosed reports whether err means the connection is gone.
func IsClosed(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || errors.Is(err, unix.ECONNRESET) || errors.Is(err, unix.EPIPE)
}
