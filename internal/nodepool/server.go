package nodepool

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/memfit"
	"github.com/kvoffload/kvoffload/internal/nodepool/wire"
	"github.com/kvoffload/kvoffload/internal/tiered"
	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/kvoffload/kvoffload/mmapmem"
)

// Defaults of ServerConfig.
const (
	DefaultRegionBytes int64 = 4 << 30
	// DefaultPushQueue is how many pushes (region announcements, retire
	// notices, event batches) may wait for a client that does not read;
	// beyond it the node drops that client's connection (what it holds is
	// released when its process exits, as for any client that leaves
	// without goodbye).
	DefaultPushQueue = 1024
)

// MaxRegionBytes bounds ServerConfig.RegionBytes: one region is one CUDA
// registration range in every client (cuMemHostRegister is done in ranges
// of at most 64 GiB), so no slot straddles two.
const MaxRegionBytes int64 = 64 << 30

// ServerConfig configures a node.
type ServerConfig struct {
	// Socket is the path of the unix socket (SOCK_SEQPACKET), at most
	// MaxSocketPath bytes. Required. The node holds an exclusive lock
	// (flock) on Socket+".lock" while it runs, taken before anything else:
	// a second node on the path is refused, as is a live socket of another
	// kind; a stale socket (nothing listening) is replaced.
	Socket string
	// PoolBytes is the pool's size in bytes. Required.
	PoolBytes int64
	// RegionBytes is the size of each region (the unit of Trim); the last
	// region takes the rest. Default DefaultRegionBytes, at most
	// MaxRegionBytes.
	RegionBytes int64
	// Group, when set (a group name or a numeric gid), makes the socket
	// 0660 owned by that group and admits peers in it; otherwise the socket
	// is 0600 and only peers of the node's uid (and root) are admitted.
	Group string
	// HugeTLB maps regions from hugetlbfs (MFD_HUGETLB) when pages are
	// reserved, falling back to shared memory's pages (PageMode says
	// which applies, and why). `kvoffload serve` sets it unless
	// --hugetlb=false.
	HugeTLB bool
	// Policy is "lru" (default) or "tinylfu".
	Policy string
	// LowWatermark: free slots kept by evicting ahead of demand (kvcache).
	// 0: none without a disk tier; with one (Disk), a 64th of the pool's
	// slots, at most 64, as the embedded engine keeps, so that evicted
	// blocks are written back from their demoting slots rather than copied
	// out first (tiered.DiskConfig). Negative: none.
	LowWatermark int
	// PrefaultThreads populate each region at start (0: mmapmem's default).
	PrefaultThreads int
	// NoPrefault leaves the regions' pages to the first client that
	// touches them (tests with large pools).
	NoPrefault bool
	// OnEvents, when set, receives the node's KV events in batches (as a
	// subscribed client would), on the node's fan-out goroutine; it must
	// not block for long (events beyond a bounded queue are dropped and
	// counted). `kvoffload serve --events` publishes them.
	OnEvents func([]wire.Event)
	// Logf, when set, receives one line per connection event.
	Logf func(format string, args ...any)
	// BindNUMA binds the pool's memory to NUMA node NUMANode (mbind), and
	// the pool must fit that node's free memory.
	BindNUMA bool
	NUMANode int
	// MaxConns caps the node's connections, every client's together; one
	// past it is told why and closed at once. 0: DefaultMaxConns, lowered
	// to what RLIMIT_NOFILE leaves (a connection costs two descriptors).
	MaxConns int
	// MaxConnsPerClient caps the connections of one client process (its
	// pid, SO_PEERCRED). 0: DefaultMaxConnsPerClient, at most a quarter of
	// MaxConns.
	MaxConnsPerClient int
	// MaxConnsPerUser caps the connections of one user's processes
	// together (the SO_PEERCRED uid), for a node that admits a group.
	// 0: MaxConns.
	MaxConnsPerUser int
	// HelloTimeout closes a connection that has not said Hello by then.
	// 0: DefaultHelloTimeout.
	HelloTimeout time.Duration
	// ClientShare is the fraction of the pool's slots, in (0, 1], that one
	// client process (all its connections) may hold at once: reserved for
	// its stores, leased, or loading. Past it, its stores are refused full,
	// its lookups lease a shorter prefix and its loads find fewer blocks.
	// 0: DefaultClientShare.
	ClientShare float64
	// ReserveTimeout: a reservation neither committed nor aborted this
	// long after BeginStore expires (the block never becomes ready, the
	// slot goes back to the pool, a later commit of it is refused). A
	// client must not write into a reservation after it. 0:
	// DefaultReserveTimeout.
	ReserveTimeout time.Duration
	// Disk, when set, puts a disk tier under the pool (see tiered.DiskConfig). It
	// opens with the first client's layout (the records' size is the
	// slot's); a directory it cannot use leaves the node serving without
	// it, Stats.DiskError saying why.
	Disk *tiered.DiskConfig
}

// Server is a node: it owns the pool's memfd-backed regions, the block
// index over them (a kvcache.Cache), every client's reservations and
// leases, and the regions' retirement. See the package comment.
type Server struct {
	cfg      ServerConfig
	ln       *net.UnixListener
	gid      int // -1: owner only
	pageMode string
	lim      limits
	accts    accounts
	lock     *os.File  // the flock on Socket+".lock", held until Close
	sockID   [2]uint64 // dev and inode of the socket bound: Close removes only it
	sys      memfit.System
	// beforeRegion, when set (tests), runs before each region is mapped.
	beforeRegion                    func(id uint32)
	refusedLog, acceptLog, helloLog atomic.Uint64

	mu          sync.Mutex
	cache       *kvcache.Cache // created by the first Hello, with its layout
	slotSize    uint64
	namespaces  map[string]*nsRec
	regions     map[uint32]*regionRec
	peers       map[uint32]*peer
	unhelloed   map[*peer]bool // connections that have not said Hello yet
	nextPeer    uint32
	closed      bool
	draining    atomic.Int32 // regions draining (RemoveRegion'd, not yet releasable)
	freedBytes  int64        // given back by Trim so far
	subscribers atomic.Int32

	waits   map[int32]*exitWait // by pid: clients disconnected without goodbye, still running
	wg      sync.WaitGroup
	stop    chan struct{}
	events  chan wire.Event
	disk    *tiered.Tier // nil: no disk tier (or none yet: the first Hello opens it)
	diskErr string
	// beforeDiskPut, when set (tests, before the first client), runs in
	// the disk tier's writers before each write.
	beforeDiskPut func(kvcache.Key)
	// beforeDiskGet, likewise, runs before each read of a promotion.
	beforeDiskGet func(kvcache.Key)
	// beforeReply, when set (tests), sees each reply to a client's request
	// before it is sent, and may change it.
	beforeReply atomic.Pointer[func(*wire.Msg)]
	counter     struct {
		accepted, refused, malformed, releasedOnExit, releasedOnBye atomic.Uint64
		eventsDropped, peersDropped, internal                       atomic.Uint64
		refusedCap, acceptErrors, helloTimeouts, expired, overShare atomic.Uint64
	}
}

type nsRec struct {
	id     uint32
	layout wire.Layout
}

type regionRec struct {
	id      uint32
	r       *mmapmem.Region
	state   regionState
	pending map[uint32]bool // peers yet to acknowledge the retirement
}

type regionState uint8

const (
	regionActive   regionState = iota
	regionDraining             // RemoveRegion'd: slots still reserved or leased
	regionRetiring             // drained; waiting for clients to unmap it
)

// ErrServerClosed: the node was closed.
var ErrServerClosed = errors.New("nodepool: node closed")

// MaxSocketPath is the longest socket path: a unix socket address
// (sun_path) holds 108 bytes, the terminating NUL included.
const MaxSocketPath = 107

// ErrInsufficientMemory: the pool does not fit what the machine allows
// (MemAvailable, the memory cgroup's limit, RLIMIT_AS, the NUMA node's
// free memory); the error says how much is available and where the limit
// comes from.
var ErrInsufficientMemory = errors.New("nodepool: insufficient memory for the pool")

// NewServer is NewServerContext without a context.
func NewServer(cfg ServerConfig) (*Server, error) {
	return NewServerContext(context.Background(), cfg)
}

// NewServerContext checks the configuration, takes the socket's lock,
// checks that the whole pool fits the machine before it maps anything
// (ErrInsufficientMemory), maps the pool region by region (ctx ending
// between two stops it: what was mapped is unmapped and ctx's error
// returned) and listens on cfg.Socket. Serve must then run.
func NewServerContext(ctx context.Context, cfg ServerConfig) (*Server, error) {
	return newServer(ctx, cfg, memfit.Host(), nil)
}

// CheckConfig reports the first of cfg's values that NewServer would
// refuse before it touches the machine, with the value and its limit.
func CheckConfig(cfg ServerConfig) error {
	_, err := checkConfig(cfg)
	return err
}

func checkConfig(cfg ServerConfig) (ServerConfig, error) {
	switch {
	case cfg.Socket == "":
		return cfg, errors.New("nodepool: a socket path is required")
	case len(cfg.Socket) > MaxSocketPath:
		return cfg, fmt.Errorf("nodepool: socket path %q is %d bytes, at most %d (a unix socket address holds %d bytes, its terminating NUL included)",
			cfg.Socket, len(cfg.Socket), MaxSocketPath, MaxSocketPath+1)
	case cfg.PoolBytes <= 0:
		return cfg, fmt.Errorf("nodepool: pool size %d bytes: must be positive", cfg.PoolBytes)
	case cfg.RegionBytes < 0:
		return cfg, fmt.Errorf("nodepool: region size %d bytes: must not be negative (0: the default %d)", cfg.RegionBytes, DefaultRegionBytes)
	case cfg.RegionBytes > MaxRegionBytes:
		return cfg, fmt.Errorf("nodepool: region size %d bytes: at most %d (one registration range in each client)", cfg.RegionBytes, MaxRegionBytes)
	}
	if cfg.RegionBytes == 0 {
		cfg.RegionBytes = DefaultRegionBytes
	}
	_, err := resolveLimits(&cfg, 0)
	return cfg, err
}

func newServer(ctx context.Context, cfg ServerConfig, sys memfit.System, beforeRegion func(uint32)) (*Server, error) {
	cfg, err := checkConfig(cfg)
	if err != nil {
		return nil, err
	}
	if cfg.Policy == "" {
		cfg.Policy = "lru"
	}
	if cfg.Policy != "lru" && cfg.Policy != "tinylfu" {
		return nil, fmt.Errorf("nodepool: policy %q: lru or tinylfu", cfg.Policy)
	}
	if cfg.Logf == nil {
		cfg.Logf = func(string, ...any) {}
	}
	if cfg.Disk, err = checkDisk(cfg.Disk); err != nil {
		return nil, err
	}
	lim, err := resolveLimits(&cfg, (cfg.PoolBytes+cfg.RegionBytes-1)/cfg.RegionBytes)
	if err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, gid: -1, namespaces: map[string]*nsRec{}, regions: map[uint32]*regionRec{},
		peers: map[uint32]*peer{}, unhelloed: map[*peer]bool{}, waits: map[int32]*exitWait{}, stop: make(chan struct{}), events: make(chan wire.Event, 8192),
		lim: lim, accts: accounts{byPid: map[int32]*account{}, byUid: map[uint32]int{}}, sys: sys, beforeRegion: beforeRegion}
	if cfg.Group != "" {
		gid, err := lookupGroup(cfg.Group)
		if err != nil {
			return nil, err
		}
		s.gid = gid
	}
	if cfg.OnEvents != nil {
		s.subscribers.Add(1)
	}
	if err := s.lockSocket(); err != nil {
		return nil, err
	}
	node := -1
	if cfg.BindNUMA {
		node = cfg.NUMANode
	}
	// With HugeTLB, the free huge pages hold that much of the pool (the
	// rest falls back to shared memory's pages, region by region).
	need, huge := cfg.PoolBytes, int64(0)
	if cfg.HugeTLB {
		huge = min(s.sys.HugePagesFree(), need)
		need -= huge
	}
	if err := s.sys.CheckFits(need, false, node); need > 0 && err != nil {
		s.unlock()
		if huge > 0 {
			return nil, fmt.Errorf("%w: pool of %d bytes, %d of them beyond the free huge pages: %w", ErrInsufficientMemory, cfg.PoolBytes, need, err)
		}
		return nil, fmt.Errorf("%w: pool of %d bytes: %w", ErrInsufficientMemory, cfg.PoolBytes, err)
	}
	if err := s.mapPool(ctx); err != nil {
		s.unmapAll()
		s.unlock()
		return nil, err
	}
	if err := s.listen(); err != nil {
		s.unmapAll()
		s.unlock()
		return nil, err
	}
	return s, nil
}

func lookupGroup(g string) (int, error) {
	if n, err := strconv.Atoi(g); err == nil && n >= 0 {
		return n, nil
	}
	gr, err := user.LookupGroup(g)
	if err != nil {
		return -1, fmt.Errorf("nodepool: group %q: %w", g, err)
	}
	return strconv.Atoi(gr.Gid)
}

// mapPool maps every region (memfd, fallocate'd, populated unless
// NoPrefault) and decides the page mode Info reports.
func (s *Server) mapPool(ctx context.Context) error {
	shmem := shmemEnabled()
	opts := mmapmem.Options{Memfd: true, MemfdName: "kvoffload-node", HugeTLB: s.cfg.HugeTLB,
		PrefaultThreads: s.cfg.PrefaultThreads, NoPrefault: s.cfg.NoPrefault,
		BindNUMA: s.cfg.BindNUMA, NUMANode: s.cfg.NUMANode,
		// MADV_HUGEPAGE matters on shared memory only where shmem_enabled
		// is advise (always/within_size need no advice, never/deny refuse).
		NoTHP: shmem == "never" || shmem == "deny"}
	left, id := s.cfg.PoolBytes, uint32(1)
	var huge, thp int
	fallback := ""
	for left > 0 {
		if s.beforeRegion != nil {
			s.beforeRegion(id)
		}
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("nodepool: stopped while mapping the pool, after %d of %d bytes: %w", s.cfg.PoolBytes-left, s.cfg.PoolBytes, err)
		}
		size := min(left, s.cfg.RegionBytes)
		r, err := mmapmem.New(size, opts)
		if err != nil {
			return fmt.Errorf("nodepool: map region %d of %d bytes: %w", id, size, err)
		}
		s.regions[id] = &regionRec{id: id, r: r}
		if r.HugeTLB() {
			huge++
		} else if r.THP() {
			thp++
		}
		if fallback == "" && s.cfg.HugeTLB && !r.HugeTLB() {
			fallback = r.Fallback()
		}
		left -= size
		id++
	}
	var thpBytes, total int64
	if huge == 0 && !s.cfg.NoPrefault && thp > 0 {
		// What the kernel granted, measured on the node's mapping.
		for _, rr := range s.regions {
			n, err := mmapmem.HugeBytes(rr.r)
			if err == nil {
				thpBytes += n
			}
			total += rr.r.Mapped()
		}
	}
	switch {
	case huge == len(s.regions):
		s.pageMode = "hugetlb (hugetlbfs memfd)"
	case huge > 0:
		s.pageMode = fmt.Sprintf("hugetlb for %d of %d regions, base pages for the rest", huge, len(s.regions))
	case shmem == "never" || shmem == "deny" || shmem == "":
		s.pageMode = fmt.Sprintf("base pages (shmem_enabled=%s: no transparent huge pages on shared memory)", orUnknown(shmem))
	case total > 0:
		s.pageMode = fmt.Sprintf("transparent huge pages for %d of %d bytes (shmem_enabled=%s, MADV_HUGEPAGE)", thpBytes, total, shmem)
	default:
		s.pageMode = fmt.Sprintf("transparent huge pages where the kernel grants them (shmem_enabled=%s, MADV_HUGEPAGE)", shmem)
	}
	if huge == 0 && fallback != "" {
		s.pageMode += "; " + fallback
	}
	return nil
}

func orUnknown(s string) string {
	if s == "" {
		return "unknown"
	}
	return s
}

// shmemEnabled reads the bracketed choice of
// /sys/kernel/mm/transparent_hugepage/shmem_enabled ("" when unreadable).
func shmemEnabled() string {
	b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
	if err != nil {
		return ""
	}
	s := string(b)
	i, j := strings.IndexByte(s, '['), strings.IndexByte(s, ']')
	if i < 0 || j < i {
		return ""
	}
	return s[i+1 : j]
}

func (s *Server) unmapAll() {
	for id, rr := range s.regions {
		_ = rr.r.Close()
		delete(s.regions, id)
	}
}

// listen binds the socket in a private directory, sets its mode (0600, or
// 0660 and the group), then renames it into place, so that it is never
// reachable with a wider mode.
func (s *Server) listen() error {
	path := s.cfg.Socket
	dir, err := os.MkdirTemp(filepath.Dir(path), ".kvo")
	if err != nil {
		return fmt.Errorf("nodepool: %w", err)
	}
	defer os.RemoveAll(dir)
	tmp := filepath.Join(dir, "s")
	if len(tmp) > MaxSocketPath {
		return fmt.Errorf("nodepool: socket path %q: the temporary path it is bound at first, %q, is %d bytes, at most %d: use a shorter directory",
			path, tmp, len(tmp), MaxSocketPath)
	}
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: tmp, Net: "unixpacket"})
	if err != nil {
		return fmt.Errorf("nodepool: listen: %w", err)
	}
	ln.SetUnlinkOnClose(false)
	mode := os.FileMode(0o600)
	if s.gid >= 0 {
		mode = 0o660
		if err := os.Chown(tmp, -1, s.gid); err != nil {
			_ = ln.Close()
			return fmt.Errorf("nodepool: chown socket to group %d: %w", s.gid, err)
		}
	}
	if err := os.Chmod(tmp, mode); err != nil {
		_ = ln.Close()
		return fmt.Errorf("nodepool: chmod socket: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Stat(tmp, &st); err != nil {
		_ = ln.Close()
		return fmt.Errorf("nodepool: stat socket: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = ln.Close()
		return fmt.Errorf("nodepool: move socket into place: %w", err)
	}
	s.sockID = [2]uint64{uint64(st.Dev), st.Ino}
	s.ln = ln
	return nil
}

// Addr is the socket's path.
func (s *Server) Addr() string { return s.cfg.Socket }

// PageMode says which pages back the pool (hugetlbfs, transparent huge
// pages as shmem_enabled allows, or base pages), in words.
func (s *Server) PageMode() string { return s.pageMode }

// Serve accepts clients until Close; it returns nil after Close. A failed
// accept (out of descriptors or memory, a connection aborted) is counted
// (Stats.AcceptErrors) and retried after a pause: it never ends Serve. A
// connection past ServerConfig.MaxConns or MaxConnsPerClient is told why
// and closed at once.
func (s *Server) Serve() error {
	s.wg.Add(2)
	go s.fanOutEvents()
	go s.expirer()
	defer s.wg.Done()
	var delay time.Duration
	for {
		c, err := s.ln.AcceptUnix()
		if err != nil {
			select {
			case <-s.stop:
				return nil
			default:
			}
			if errors.Is(err, net.ErrClosed) {
				return fmt.Errorf("nodepool: accept: %w", err)
			}
			if s.acceptBackoff(&delay, err) {
				return nil
			}
			continue
		}
		delay = 0
		a, cred := s.admit(c)
		if a == nil {
			continue
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer s.accts.closed(a)
			s.servePeer(c, a, cred)
		}()
	}
}

// Close stops accepting, disconnects every client, closes the index and
// unmaps the node's regions (clients keep their own mappings until they
// unmap them). Leases and reservations die with the index. With a disk
// tier it first writes the write-backs queued and, with
// tiered.DiskConfig.WriteBackOnClose, the pool's blocks not on disk yet, however
// long they take: CloseContext bounds the latter.
func (s *Server) Close() error { return s.CloseContext(context.Background()) }

// CloseContext is Close with a bound on the disk tier's write-back at
// close (tiered.DiskConfig.WriteBackOnClose): once ctx ends no further block is
// written (a write in progress finishes) and the rest are counted
// (Stats.DiskLeftAtClose); the node closes as Close does, and ctx's end is
// not an error. Nothing else of Close waits on ctx.
func (s *Server) CloseContext(ctx context.Context) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return ErrServerClosed
	}
	s.closed = true
	close(s.stop)
	for _, w := range s.waits {
		_ = w.f.Close()
	}
	peers := make([]*peer, 0, len(s.peers)+len(s.unhelloed))
	for _, p := range s.peers {
		peers = append(peers, p)
	}
	for p := range s.unhelloed {
		peers = append(peers, p) // not waited for until their HelloTimeout
	}
	s.mu.Unlock()
	_ = s.ln.Close()
	s.removeSocket()
	s.unlock()
	for _, p := range peers {
		p.disconnect()
	}
	s.wg.Wait()
	s.closeDisk(ctx)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cache != nil {
		s.cache.Close()
	}
	s.unmapAll()
	return nil
}

// ---- trim ------------------------------------------------------------------

// TrimResult is what Trim did.
type TrimResult struct {
	RequestedBytes int64 `json:"requested_bytes"`
	// FreedBytes: regions retired at once (no client had them mapped, or
	// none was connected); their memory is gone.
	FreedBytes int64 `json:"freed_bytes"`
	// PendingBytes: regions draining (slots still reserved or leased) or
	// waiting for clients to unmap them; freed when the last one does.
	PendingBytes int64 `json:"pending_bytes"`
	Regions      int   `json:"regions"`
}

// Trim gives back at least bytes of the pool (whole regions, the
// highest-numbered first): each region leaves the index at once (its ready
// blocks evicted, new stores never placed in it) and is retired once its
// last reservation and lease end: every client that mapped it is told to
// unmap it (RegionRetire), and the node closes it once each acknowledged or
// exited.
func (s *Server) Trim(bytes int64) (TrimResult, error) {
	res := TrimResult{RequestedBytes: bytes}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return res, ErrServerClosed
	}
	ids := make([]uint32, 0, len(s.regions))
	for id, rr := range s.regions {
		if rr.state == regionActive {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	var got int64
	sizes := map[uint32]int64{}
	for i := len(ids) - 1; i >= 0 && got < bytes; i-- {
		rr := s.regions[ids[i]]
		got += rr.r.Len()
		res.Regions++
		sizes[rr.id] = rr.r.Len()
		if s.cache == nil {
			// No client ever connected: nothing is indexed or mapped.
			_ = rr.r.Close()
			delete(s.regions, rr.id)
			s.freedBytes += rr.r.Len()
			continue
		}
		rr.state = regionDraining
		s.draining.Add(1)
		if _, err := s.cache.RemoveRegion(kvcache.RegionID(rr.id)); err != nil {
			s.mu.Unlock()
			return res, fmt.Errorf("nodepool: trim region %d: %w", rr.id, err)
		}
	}
	s.mu.Unlock()
	s.reap()
	s.mu.Lock()
	defer s.mu.Unlock()
	for id, n := range sizes {
		if _, ok := s.regions[id]; ok {
			res.PendingBytes += n
		} else {
			res.FreedBytes += n
		}
	}
	return res, nil
}

// reap retires the regions that finished draining: each client that holds
// one is told to unmap it; a region no client holds is closed at once. It
// returns the regions closed.
func (s *Server) reap() []uint32 {
	if s.draining.Load() == 0 {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cache == nil || s.closed {
		return nil
	}
	var closed []uint32
	for _, id := range s.cache.TakeReleasable(nil) {
		rr := s.regions[uint32(id)]
		if rr == nil || rr.state != regionDraining {
			continue
		}
		s.draining.Add(-1)
		rr.state = regionRetiring
		rr.pending = map[uint32]bool{}
		for pid, p := range s.peers {
			if p.regions[rr.id] {
				rr.pending[pid] = true
				p.push(&wire.Msg{Type: wire.TRegionRetire, Region: wire.Region{ID: rr.id}}, -1)
			}
		}
		if s.maybeFree(rr) {
			closed = append(closed, rr.id)
		}
	}
	return closed
}

// maybeFree closes a retiring region once no client holds it. s.mu held.
func (s *Server) maybeFree(rr *regionRec) bool {
	if rr.state != regionRetiring || len(rr.pending) > 0 {
		return false
	}
	s.freedBytes += rr.r.Len()
	_ = rr.r.Close()
	delete(s.regions, rr.id)
	s.cfg.Logf("region %d freed (%d bytes)", rr.id, rr.r.Len())
	return true
}

// acked records that peer p unmapped region id (or exited). s.mu held.
func (s *Server) acked(p *peer, id uint32) {
	delete(p.regions, id)
	if rr := s.regions[id]; rr != nil && rr.state == regionRetiring {
		delete(rr.pending, p.id)
		s.maybeFree(rr)
	}
}
