package nodepool

import (
	"errors"
	"fmt"
	"net"
	"os"

	"golang.org/x/sys/unix"
)

// lockSocket takes an exclusive flock on Socket+".lock" (created 0600 when
// missing, never removed: a lock file removed and recreated would let two
// nodes hold locks on two files), then checks the path: another kind of
// file there is an error, a live socket (a node of a release without the
// lock) too, a stale socket is removed. Holding the lock from before the
// check until Close makes the check and the bind one step: of nodes started
// at once on one path, exactly one gets past here.
func (s *Server) lockSocket() error {
	path := s.cfg.Socket
	lockPath := path + ".lock"
	f, err := os.OpenFile(lockPath, os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return fmt.Errorf("nodepool: lock file: %w", err)
	}
	for {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		_ = f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return fmt.Errorf("nodepool: a node already serves %s (it holds the lock %s)", path, lockPath)
		}
		return fmt.Errorf("nodepool: lock %s: %w", lockPath, err)
	}
	s.lock = f
	if fi, err := os.Lstat(path); err == nil {
		fail := func(err error) error {
			s.unlock()
			return err
		}
		if fi.Mode()&os.ModeSocket == 0 {
			return fail(fmt.Errorf("nodepool: %s exists and is not a socket", path))
		}
		if c, err := net.Dial("unixpacket", path); err == nil {
			_ = c.Close()
			return fail(fmt.Errorf("nodepool: a node already listens on %s", path))
		}
		if err := os.Remove(path); err != nil {
			return fail(fmt.Errorf("nodepool: remove stale socket: %w", err))
		}
	}
	return nil
}

// unlock releases the socket's lock (closing the file releases the flock).
func (s *Server) unlock() {
	if s.lock != nil {
		_ = s.lock.Close()
		s.lock = nil
	}
}

// removeSocket removes the socket path if it is still the socket this node
// bound (same device and inode): a path another node has bound since (after
// this one's socket was removed by hand) is left alone.
func (s *Server) removeSocket() {
	var st unix.Stat_t
	if err := unix.Lstat(s.cfg.Socket, &st); err != nil {
		return
	}
	if [2]uint64{uint64(st.Dev), st.Ino} == s.sockID {
		_ = os.Remove(s.cfg.Socket)
	}
}
