package nodepool

// A connection's admission and end: the peer's credentials (SO_PEERCRED,
// its pidfd) and the admission check, servePeer (one connection, from
// accept to release), the wait for a client process's exit (exitWait,
// waitExit), and release, which gives back what a peer held.
//
// Locks: s.mu guards s.unhelloed, s.waits, s.peers and the peer's regions
// and subscribed. release takes s.mu, then, once it is released, p.mu
// (to drain p.held), then s.accts.mu: one at a time, none nested.

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/kvoffload/kvoffload/internal/nodepool/wire"
	"golang.org/x/sys/unix"
)

// errPeerGone fails the stores of a client that exited without committing.
var errPeerGone = errors.New("nodepool: client exited before committing")

// peerUcred reads SO_PEERCRED (no descriptor opened: the accept loop
// checks the connection caps with it first).
func peerUcred(c *net.UnixConn) (unix.Ucred, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return unix.Ucred{}, err
	}
	var cred *unix.Ucred
	var cerr error
	err = rc.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	})
	if err == nil {
		err = cerr
	}
	if err != nil {
		return unix.Ucred{}, fmt.Errorf("SO_PEERCRED: %w", err)
	}
	return *cred, nil
}

// peerPidfd opens a pidfd for the peer: from SO_PEERPIDFD where the kernel
// has it (6.5+: the pidfd of the very process that connected), else
// pidfd_open of the SO_PEERCRED pid.
func peerPidfd(c *net.UnixConn, cred unix.Ucred) (int, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return -1, err
	}
	pidfd := -1
	_ = rc.Control(func(fd uintptr) {
		if v, e := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PEERPIDFD); e == nil && v >= 0 {
			pidfd = v
			unix.CloseOnExec(v)
		}
	})
	if pidfd < 0 {
		if pidfd, err = unix.PidfdOpen(int(cred.Pid), 0); err != nil {
			return -1, fmt.Errorf("pidfd_open(%d): %w", cred.Pid, err)
		}
	}
	return pidfd, nil
}

// admitted: the node's uid, root, or (with Group) a member of the group
// (primary or supplementary, from /proc/PID/status).
func (s *Server) admitted(cred unix.Ucred) bool {
	if int(cred.Uid) == os.Getuid() || cred.Uid == 0 {
		return true
	}
	if s.gid < 0 {
		return false
	}
	if int(cred.Gid) == s.gid {
		return true
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(int(cred.Pid)) + "/status")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if g, ok := strings.CutPrefix(line, "Groups:"); ok {
			for _, f := range strings.Fields(g) {
				if f == strconv.Itoa(s.gid) {
					return true
				}
			}
		}
	}
	return false
}

// servePeer serves one admitted connection (Serve counted it against the
// caps, in account a). Until its Hello it costs a small receive buffer and
// this goroutine, and it has HelloTimeout to say Hello.
func (s *Server) servePeer(c *net.UnixConn, a *account, cred unix.Ucred) {
	conn := wire.NewConnSize(c, preHelloRecv)
	pidfd := -1
	var err error
	if !s.admitted(cred) {
		err = fmt.Errorf("uid %d gid %d is not admitted to this node", cred.Uid, cred.Gid)
	} else {
		pidfd, err = peerPidfd(c, cred)
	}
	if err != nil {
		s.counter.refused.Add(1)
		s.logRare(&s.refusedLog, "refused a connection: %v", err)
		_ = conn.Send(&wire.Msg{Type: wire.TError, Code: wire.CodeHandshake, Text: err.Error()}, -1)
		_ = conn.Close()
		return
	}
	s.counter.accepted.Add(1)
	p := &peer{s: s, conn: conn, cred: cred, pidfd: pidfd, acct: a, regions: map[uint32]bool{}, done: make(chan struct{})}
	p.held.acct = a
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		_ = unix.Close(pidfd)
		_ = conn.Close()
		return
	}
	s.unhelloed[p] = true
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.unhelloed, p)
		s.mu.Unlock()
	}()
	timer := time.AfterFunc(s.lim.hello, func() {
		if !p.helloed.Load() {
			s.counter.helloTimeouts.Add(1)
			s.logRare(&s.helloLog, "pid %d said no Hello within %v: connection closed", cred.Pid, s.lim.hello)
			p.disconnect()
		}
	})
	registered := p.serve()
	timer.Stop()
	p.disconnect()
	p.stopPromoter()
	if !registered {
		_ = unix.Close(pidfd)
		return
	}
	if p.bye {
		s.release(p)
		s.counter.releasedOnBye.Add(1)
		return
	}
	// The client may still be running, its copies in flight: its
	// reservations and leases are released only once it has exited.
	s.waitExit(p)
}

// exitWait is the wait for one client process's exit, shared by every
// connection of that process that ended without goodbye.
type exitWait struct {
	f     *os.File // the first such connection's pidfd
	peers []*peer
}

// exited reports whether a pidfd is readable: its process has exited.
func exited(fd int) bool {
	n, _ := unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, 0)
	return n > 0
}

// waitExit waits for the client's process to exit (its pidfd turns
// readable once the process has exited: its memory and files, GPU
// contexts among them, are gone), then releases what it held. The wait
// parks on the runtime's poller (the pidfd is pollable), not on a thread,
// and one wait serves every dropped connection of a process: a connection
// joins the wait of its pid only while that wait's pidfd is not readable,
// that is while the process that owned the pid is alive, so it is the
// same process (a pid is not reused while its process lives).
func (s *Server) waitExit(p *peer) {
	pid := p.cred.Pid
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		_ = unix.Close(p.pidfd)
		return // the index is closing: nothing to release into
	}
	if w := s.waits[pid]; w != nil && !exited(int(w.f.Fd())) {
		w.peers = append(w.peers, p)
		s.mu.Unlock()
		_ = unix.Close(p.pidfd)
		p.pidfd = -1
		return
	}
	if err := unix.SetNonblock(p.pidfd, true); err != nil {
		s.mu.Unlock()
		s.cfg.Logf("client %d (pid %d): pidfd: %v; its holdings stay until the node stops", p.id, pid, err)
		_ = unix.Close(p.pidfd)
		return
	}
	w := &exitWait{f: os.NewFile(uintptr(p.pidfd), "pidfd"), peers: []*peer{p}}
	p.pidfd = -1
	s.waits[pid] = w // a stale wait of an earlier process with this pid keeps running on its own
	s.mu.Unlock()
	done := false
	rc, err := w.f.SyscallConn()
	if err == nil {
		err = rc.Read(func(fd uintptr) bool {
			done = exited(int(fd))
			return done
		})
	}
	s.mu.Lock()
	if s.waits[pid] == w {
		delete(s.waits, pid)
	}
	peers := w.peers
	s.mu.Unlock()
	_ = w.f.Close()
	if !done {
		select {
		case <-s.stop: // Close closed the pidfd
		default:
			s.cfg.Logf("pid %d: waiting for its exit: %v; what its clients hold stays until the node stops", pid, err)
		}
		return
	}
	for _, q := range peers {
		s.cfg.Logf("client %d (pid %d) exited: releasing %d reservations, %d leases, %d loads",
			q.id, pid, q.held.reserved, q.held.leases, q.held.loads)
		s.release(q)
		s.counter.releasedOnExit.Add(1)
	}
}

// release gives back everything p held: its reservations fail (their
// blocks never become ready), its leases and loads end, and its regions
// count as unmapped.
func (s *Server) release(p *peer) {
	if p.pidfd >= 0 {
		_ = unix.Close(p.pidfd)
	}
	s.mu.Lock()
	c := s.cache
	delete(s.peers, p.id)
	if p.subscribed {
		p.subscribed = false
		s.subscribers.Add(-1)
	}
	for id := range p.regions {
		s.acked(p, id)
	}
	s.mu.Unlock()
	p.mu.Lock()
	reserved, reads := p.held.drain()
	p.mu.Unlock()
	if c != nil {
		if len(reserved) > 0 {
			_ = c.CompleteStore(reserved, errPeerGone)
		}
		if len(reads) > 0 {
			if err := c.EndReads(reads); err != nil {
				s.counter.internal.Add(1)
				s.cfg.Logf("client %d: releasing its leases and loads: %v", p.id, err)
			}
		}
	}
	if p.acct != nil {
		s.accts.mu.Lock()
		s.accts.forget(p.acct)
		s.accts.mu.Unlock()
	}
	s.reap()
}
