package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/kvoffload/kvoffload/events"
	"github.com/kvoffload/kvoffload/internal/kvseen"
	"github.com/kvoffload/kvoffload/internal/nodepool"
	"github.com/kvoffload/kvoffload/internal/nodepool/wire"
	"github.com/kvoffload/kvoffload/internal/tiered"
	"github.com/kvoffload/kvoffload/metrics"
	"github.com/kvoffload/kvoffload/offload"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

var serveCommand = command{
	name:    "serve",
	summary: "Run a node pool: one pinned-pool owner and block index for every process of the machine.",
	details: `serve maps the pool (memfd-backed regions, fallocate'd and populated),
listens on a unix SOCK_SEQPACKET socket and serves clients (offload.Dial, kvoffload demo --connect):
each receives the regions' file descriptors, maps them and copies with its
own GPU; the node holds the index, leases, reservations and eviction, and
needs no GPU. The socket is 0600 (0660 with --group); a peer must have the
node's uid (or root, or be in --group). One node is one trust domain: run
one per tenant. It prints the socket and the page mode, and stops cleanly
on SIGTERM or SIGINT; with --disk-write-back-on-close it first writes the
pool's blocks not on disk yet, for at most --disk-close-timeout (a second
signal ends it at once), and says how many it wrote and left.`,
	flags: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
		var cfg nodepool.ServerConfig
		cfg.PoolBytes = 1 << 30
		fs.StringVar(&cfg.Socket, "socket", "", "the unix socket `path` to listen on (required)")
		fs.Var(sizeFlag{&cfg.PoolBytes}, "pool", "pool size in `bytes`")
		fs.Var(sizeFlag{&cfg.RegionBytes}, "region", "region size in `bytes`, the unit of trim (default 4GiB)")
		fs.StringVar(&cfg.Group, "group", "", "admit this `group` (name or gid): socket 0660 owned by it")
		fs.BoolVar(&cfg.HugeTLB, "hugetlb", true, "map the pool from hugetlbfs (MFD_HUGETLB) where pages are reserved, else shared memory's pages")
		fs.StringVar(&cfg.Policy, "policy", "lru", "eviction `policy`: lru or tinylfu")
		fs.IntVar(&cfg.LowWatermark, "low-watermark", 0, "free `slots` kept by evicting ahead of demand")
		numaNode := fs.Int("numa-node", -1, "bind the pool to this NUMA `node` (-1: not bound); the pool must fit its free memory")
		fs.IntVar(&cfg.MaxConns, "max-conns", 0, fmt.Sprintf("at most this many `connections`, every client's together (0: %d, lowered to what RLIMIT_NOFILE allows)", nodepool.DefaultMaxConns))
		fs.IntVar(&cfg.MaxConnsPerClient, "max-conns-per-client", 0, fmt.Sprintf("at most this many `connections` of one client process (0: %d, at most a quarter of --max-conns)", nodepool.DefaultMaxConnsPerClient))
		fs.IntVar(&cfg.MaxConnsPerUser, "max-conns-per-user", 0, "at most this many `connections` of one user's processes together, with --group (0: --max-conns)")
		fs.DurationVar(&cfg.HelloTimeout, "hello-timeout", nodepool.DefaultHelloTimeout, "close a connection that says no Hello within this `duration`")
		fs.Float64Var(&cfg.ClientShare, "client-share", nodepool.DefaultClientShare, "the `fraction` of the pool's slots one client process may hold at once (reserved, leased or loading), in (0, 1]")
		fs.DurationVar(&cfg.ReserveTimeout, "reserve-timeout", nodepool.DefaultReserveTimeout, "a reservation not committed within this `duration` expires (its slot goes back to the pool)")
		metricsAddr := fs.String("metrics", "", "serve Prometheus metrics at http://`addr`/metrics")
		eventsAddr := fs.String("events", "", "publish KV events (vLLM's schema) on a ZeroMQ PUB socket at `endpoint` (tcp://host:port)")
		verbose := fs.Bool("v", false, "log connections, exits and regions to stderr")
		diskDirs := fs.String("disk", "", "add a disk tier, a records file in each `dir[,dir]`: evicted blocks seen twice are written back there (see --disk-admit-after), loaded back from it, and found by a restarted node")
		var diskBytes, writeBackBytes int64
		fs.Var(sizeFlag{&diskBytes}, "disk-bytes", "disk tier `size` with --disk (0: four times the pool)")
		admitAll := fs.Bool("disk-admit-all", false, "with --disk: write back every evicted block, not only those seen --disk-admit-after times")
		admitAfter := fs.Int("disk-admit-after", 2, "with --disk: write back an evicted block whose key was stored or looked up at least this many `times` (1 to 15; 1: every block)")
		writeThrough := fs.Bool("disk-write-through", false, "with --disk: also write every block stored as soon as it is ready (a restart finds every block stored, at a disk write each)")
		fs.Var(sizeFlag{&writeBackBytes}, "disk-write-back-bytes", "with --disk: `bytes` of evicted blocks waiting for their disk write, past which an eviction is not written back (0: 64MiB)")
		writeBackOnClose := fs.Bool("disk-write-back-on-close", false, "with --disk: at shutdown (SIGTERM, SIGINT) write every block in the pool not on disk yet, so that a restarted node finds the pool's last blocks (see --disk-close-timeout)")
		closeTimeout := fs.Duration("disk-close-timeout", 25*time.Second, "with --disk-write-back-on-close: stop writing blocks at shutdown after this `duration` (the rest are not written, and counted; the most recently used blocks first with the lru policy, at the disk's rate: a 64 GiB pool takes about 30 s at 2 GB/s)")
		return func(ctx context.Context, e *env, args []string) error {
			if err := noArgs(args); err != nil {
				return err
			}
			if cfg.Socket == "" {
				return fmt.Errorf("%w: --socket is required", errUsage)
			}
			if err := checkServeFlags(&cfg, *numaNode); err != nil {
				return err
			}
			var needDisk string
			closeTimeoutSet := false
			fs.Visit(func(f *flag.Flag) {
				if strings.HasPrefix(f.Name, "disk-") && needDisk == "" {
					needDisk = f.Name
				}
				closeTimeoutSet = closeTimeoutSet || f.Name == "disk-close-timeout"
			})
			switch {
			case diskBytes < 0:
				return fmt.Errorf("%w: --disk-bytes %d must not be negative", errUsage, diskBytes)
			case writeBackBytes < 0:
				return fmt.Errorf("%w: --disk-write-back-bytes %d must not be negative", errUsage, writeBackBytes)
			case *admitAfter < 1 || *admitAfter > kvseen.Max:
				return fmt.Errorf("%w: --disk-admit-after %d: want 1 to %d", errUsage, *admitAfter, kvseen.Max)
			case *closeTimeout <= 0:
				return fmt.Errorf("%w: --disk-close-timeout %v must be positive", errUsage, *closeTimeout)
			case needDisk != "" && *diskDirs == "":
				return fmt.Errorf("%w: --%s needs --disk", errUsage, needDisk)
			case closeTimeoutSet && !*writeBackOnClose:
				return fmt.Errorf("%w: --disk-close-timeout needs --disk-write-back-on-close", errUsage)
			case *diskDirs != "":
				if diskBytes == 0 {
					diskBytes = 4 * cfg.PoolBytes
				}
				cfg.Disk = &tiered.DiskConfig{Dirs: strings.Split(*diskDirs, ","), CapacityBytes: diskBytes,
					AdmitAll: *admitAll, AdmitAfter: *admitAfter, WriteThrough: *writeThrough, WriteBackBytes: writeBackBytes,
					WriteBackOnClose: *writeBackOnClose}
			}
			// closeNode closes the node, its write-back at close bounded by
			// --disk-close-timeout, and says what that wrote.
			closeNode := func(s *nodepool.Server) {
				ctx, cancel := context.WithTimeout(context.Background(), *closeTimeout)
				defer cancel()
				_ = s.CloseContext(ctx)
				if cfg.Disk == nil || !cfg.Disk.WriteBackOnClose {
					return
				}
				st := s.Stats()
				if !st.DiskOpen {
					return
				}
				fmt.Fprintf(e.stdout, "kvoffload serve: wrote %d blocks of the pool to disk at close", st.DiskWrittenAtClose)
				if st.DiskLeftAtClose > 0 {
					fmt.Fprintf(e.stdout, ", %d not written (--disk-close-timeout %v passed)", st.DiskLeftAtClose, *closeTimeout)
				}
				if st.DiskWriteErrors > 0 {
					fmt.Fprintf(e.stdout, "; %d disk writes failed", st.DiskWriteErrors)
				}
				fmt.Fprintln(e.stdout)
			}
			if *verbose {
				cfg.Logf = func(f string, a ...any) { fmt.Fprintf(e.stderr, "kvoffload serve: "+f+"\n", a...) }
			}
			var pub *events.Publisher
			if *eventsAddr != "" {
				var err error
				if pub, err = events.Listen(context.Background(), *eventsAddr, events.Options{}); err != nil {
					return fmt.Errorf("--events %s: %w", *eventsAddr, errors.Unwrap(err))
				}
				defer pub.Close()
				cfg.OnEvents = publisher(pub)
			}
			s, err := nodepool.NewServerContext(ctx, cfg)
			if err != nil {
				return err
			}
			done := make(chan error, 1)
			go func() { done <- s.Serve() }()
			fmt.Fprintf(e.stdout, "kvoffload serve: listening on %s (pool %s, %s)\n", s.Addr(), formatSize(cfg.PoolBytes), s.PageMode())
			if cfg.Disk != nil {
				fmt.Fprintf(e.stdout, "kvoffload serve: disk tier of %s in %s, opened with the first client's layout; %s\n",
					formatSize(diskBytes), strings.Join(cfg.Disk.Dirs, ","), diskMode(cfg.Disk))
			}
			if pub != nil {
				fmt.Fprintf(e.stdout, "kvoffload serve: publishing KV events at tcp://%s\n", pub.Addr())
			}
			if *metricsAddr != "" {
				ln, err := net.Listen("tcp", *metricsAddr)
				if err != nil {
					_ = s.Close()
					return fmt.Errorf("--metrics %s: %w", *metricsAddr, err)
				}
				mux := http.NewServeMux()
				mux.Handle("/metrics", promhttp.HandlerFor(metrics.NodeRegistry(func() metrics.NodeStats { return nodeStats(s.Stats()) }, cfg.Disk != nil), promhttp.HandlerOpts{}))
				srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
				go func() { _ = srv.Serve(ln) }()
				defer srv.Close()
				fmt.Fprintf(e.stdout, "kvoffload serve: serving Prometheus metrics at http://%s/metrics\n", ln.Addr())
			}
			select {
			case <-ctx.Done():
				closeNode(s)
				<-done
				fmt.Fprintln(e.stdout, "kvoffload serve: stopped")
				return nil
			case err := <-done:
				closeNode(s)
				if errors.Is(err, nodepool.ErrServerClosed) {
					err = nil
				}
				return err
			}
		}
	},
}

// checkServeFlags refuses serve's bad values as usage errors (exit 2),
// naming the flag, the value and the limit, before anything is mapped.
func checkServeFlags(cfg *nodepool.ServerConfig, numaNode int) error {
	switch {
	case cfg.PoolBytes <= 0:
		return fmt.Errorf("%w: --pool %s: the pool must be a positive size (at least one slot of the first client's layout)", errUsage, formatSizeFlag(cfg.PoolBytes))
	case cfg.RegionBytes > nodepool.MaxRegionBytes:
		return fmt.Errorf("%w: --region %s: at most %s (one CUDA registration range in each client)", errUsage, formatSizeFlag(cfg.RegionBytes), formatSizeFlag(nodepool.MaxRegionBytes))
	case len(cfg.Socket) > nodepool.MaxSocketPath:
		return fmt.Errorf("%w: --socket %q is %d bytes, at most %d (a unix socket address holds %d bytes, its terminating NUL included)",
			errUsage, cfg.Socket, len(cfg.Socket), nodepool.MaxSocketPath, nodepool.MaxSocketPath+1)
	case cfg.MaxConns < 0:
		return fmt.Errorf("%w: --max-conns %d must not be negative", errUsage, cfg.MaxConns)
	case cfg.MaxConnsPerClient < 0:
		return fmt.Errorf("%w: --max-conns-per-client %d must not be negative", errUsage, cfg.MaxConnsPerClient)
	case cfg.MaxConnsPerUser < 0:
		return fmt.Errorf("%w: --max-conns-per-user %d must not be negative", errUsage, cfg.MaxConnsPerUser)
	case cfg.HelloTimeout <= 0:
		return fmt.Errorf("%w: --hello-timeout %v must be positive", errUsage, cfg.HelloTimeout)
	case cfg.ReserveTimeout <= 0:
		return fmt.Errorf("%w: --reserve-timeout %v must be positive", errUsage, cfg.ReserveTimeout)
	case !(cfg.ClientShare > 0 && cfg.ClientShare <= 1):
		return fmt.Errorf("%w: --client-share %v: want a fraction of the pool above 0 and at most 1", errUsage, cfg.ClientShare)
	case numaNode < -1:
		return fmt.Errorf("%w: --numa-node %d: a node number, or -1 for none", errUsage, numaNode)
	}
	if numaNode >= 0 {
		cfg.BindNUMA, cfg.NUMANode = true, numaNode
	}
	if err := nodepool.CheckConfig(*cfg); err != nil {
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	return nil
}

// publisher sends the node's events through pub, a KVEventBatch each
// (medium CPU; the node knows no parents or tokens).
func publisher(pub *events.Publisher) func([]wire.Event) {
	var evs []offload.Event
	return func(batch []wire.Event) {
		evs = evs[:0]
		for _, w := range batch {
			k := offload.EventStored
			if w.Kind == wire.EventRemoved {
				k = offload.EventRemoved
			}
			evs = append(evs, offload.Event{Kind: k, Key: offload.Key(w.Key), Medium: offload.MediumCPU})
		}
		_ = pub.Publish(evs) // a subscriber that does not keep up loses messages, as vLLM's
	}
}

// diskMode describes the node's disk tier's writes for serve's banner.
func diskMode(dc *tiered.DiskConfig) string {
	m := fmt.Sprintf("evicted blocks seen at least %d times written back", dc.AdmitAfter)
	switch {
	case dc.AdmitAll || dc.AdmitAfter <= 1:
		m = "every evicted block written back"
	case dc.AdmitAfter == 2:
		m = "evicted blocks seen twice written back"
	}
	if dc.WriteThrough {
		m += ", every block stored written through"
	}
	if dc.WriteBackOnClose {
		m += ", the pool's blocks written at shutdown"
	}
	return m
}

// nodeStats is what metrics.NodeRegistry exports of the node's Stats.
func nodeStats(st nodepool.Stats) metrics.NodeStats {
	return metrics.NodeStats{PoolBytes: st.PoolBytes, FreedBytes: st.FreedBytes, Regions: st.Regions,
		Clients: st.Clients, WaitingExit: st.WaitingExit, Connections: st.Connections, Cache: st.Cache,
		Malformed: st.Malformed, ReleasedOnExit: st.ReleasedOnExit, EventsDropped: st.EventsDropped,
		ConnsRefused: st.ConnsRefused, AcceptErrors: st.AcceptErrors, HelloTimeouts: st.HelloTimeouts,
		OverShare: st.OverShare, ReservationsExpired: st.ReservationsExpired,
		DiskOpen: st.DiskOpen, DiskRecords: st.DiskRecords, DiskLookupHits: st.DiskLookupHits, DiskHits: st.DiskHits,
		DiskMisses: st.DiskMisses, DiskWrites: st.DiskWrites, DiskWriteErrors: st.DiskWriteErrors,
		DiskDropped: st.DiskDropped, DiskNotAdmitted: st.DiskNotAdmitted, DiskCorrupt: st.DiskCorrupt,
		DiskWrittenAtClose: st.DiskWrittenAtClose, DiskLeftAtClose: st.DiskLeftAtClose}
}
