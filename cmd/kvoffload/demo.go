package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"runtime"
	"slices"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/trace"
	"github.com/kvoffload/kvoffload/offload"
	"github.com/kvoffload/kvoffload/offload/hostsim"
)

var demoCommand = command{
	name:    "demo",
	summary: "Simulate serving through the public offload API and verify every block the engine loads back.",
	details: `A GPU KV cache of --gpu-blocks blocks (device memory on the CUDA backend, the
engine's simulated GPU on the host backend) serves a synthetic trace: shared
system prompts (Zipf), multi-turn conversations that extend their prefix, and
one-off long documents. Blocks evicted from the GPU cache are stored in the host
pool; a request whose prefix is in the pool loads it instead of recomputing it
(recomputing writes the block's content, a pure function of its key). Every
loaded block is verified — byte for byte on the host backend, by a checksum
kernel on the GPU — timed apart from the copies.

With --connect SOCKET the engine is offload.Dial's: its index and host pool
are those of the node serving SOCKET (kvoffload serve), shared with every
other process connected to it, so that several demos (one per GPU) store and
load each other's blocks, each verified as above; --pool-bytes then only
shapes the trace, and --disk and --redis are refused. A node that restarts
during the run costs the blocks it had (stores not committed, loads it cannot
serve: recomputed, as a serving loop does) and the engine reconnects; the
report counts the restarts.

With --disk, a directory the disk tier cannot use (missing, not a directory,
too small for its records file) fails the demo, naming it and why.

Exit status 3 when a loaded block holds the wrong content, 1 when the engine
reports a failed copy or a --disk directory is unusable.`,
	flags: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
		cfg := defaultDemoConfig()
		fs.DurationVar(&cfg.duration, "duration", cfg.duration, "run for `time` (0: until --requests)")
		fs.IntVar(&cfg.requests, "requests", cfg.requests, "stop after `n` requests (0: until --duration)")
		fs.Var(sizeFlag{&cfg.poolBytes}, "pool-bytes", "host pool `size` (units: 512MiB, 1GiB, 32G)")
		fs.IntVar(&cfg.gpuBlocks, "gpu-blocks", cfg.gpuBlocks, "blocks in the GPU KV cache, `n` (0: a quarter of the pool's blocks, at least 16)")
		fs.StringVar(&cfg.layoutName, "layout", cfg.layoutName, "model geometry: "+presetNames())
		fs.Var(stringFlag[offload.LayoutKind]{&cfg.layoutKind}, "layout-kind", "GPU cache layout: layer-separate|cross-layer")
		fs.Var(stringFlag[offload.Backend]{&cfg.backend}, "backend", "engine backend: auto|cuda|host")
		fs.IntVar(&cfg.device, "device", cfg.device, "CUDA device ordinal `n`")
		fs.StringVar(&cfg.pinning, "pinning", cfg.pinning, "host backend pinning: auto|mlock|none (auto: mlock when RLIMIT_MEMLOCK allows it)")
		fs.Var(stringFlag[offload.Policy]{&cfg.policy}, "policy", "host pool policy: lru|tinylfu")
		fs.Uint64Var(&cfg.seed, "seed", cfg.seed, "trace `seed`")
		fs.BoolVar(&cfg.verify, "verify", cfg.verify, "verify every loaded block")
		fs.StringVar(&cfg.diskDir, "disk", "", "add the disk tier, a records file in each `dir[,dir]` (pool evictions are written back there and loaded from it)")
		fs.StringVar(&cfg.redis, "redis", "", "add the cluster tier, a Redis Cluster at `HOST:PORT[,HOST:PORT]` (stores are written through; each request's prefix past the host hits is prefetched from it before loading)")
		fs.StringVar(&cfg.redisUser, "redis-user", "", "with --redis, the ACL `user` to AUTH as (the password comes from $"+redisPasswordEnv+"; with neither, no AUTH)")
		fs.BoolVar(&cfg.redisTLS, "redis-tls", false, "with --redis, connect with TLS (the system's roots)")
		fs.StringVar(&cfg.redisTLSCA, "redis-tls-ca", "", "with --redis, connect with TLS trusting the CAs of PEM `file` instead of the system's")
		fs.StringVar(&cfg.redisTLSName, "redis-tls-name", "", "with --redis, connect with TLS and check the nodes' certificates against `name`")
		fs.Var(sizeFlag{&cfg.diskBytes}, "disk-bytes", "disk tier `size` with --disk (0: four times the pool)")
		fs.StringVar(&cfg.diskRemove, "disk-remove-records", "", "with --disk, remove another layout's records `file[,file]` (records-<slot bytes>.kvo, as info --disk lists them) from the directories; other layouts' files are kept otherwise")
		fs.IntVar(&cfg.prefaultThreads, "prefault-threads", cfg.prefaultThreads, "threads prefaulting the pool as it grows, `n` (0: the engine's default, one per CPU up to 16)")
		fs.IntVar(&cfg.prefaultNice, "prefault-nice", cfg.prefaultNice, "nice increment `n` of the prefault threads (0: the engine's default; negative: none; at most 19)")
		fs.StringVar(&cfg.metricsAddr, "metrics", "", "serve Prometheus metrics at http://`addr`/metrics while the demo runs")
		fs.StringVar(&cfg.eventsAddr, "events", "", "publish KV events (vLLM's schema) on a ZeroMQ PUB socket at `endpoint` (tcp://*:5557)")
		fs.StringVar(&cfg.connect, "connect", "", "use the node pool serving the unix `socket` (kvoffload serve) instead of a pool of the engine's own")
		asJSON := fs.Bool("json", false, "print the report as JSON (no progress bar)")
		return func(ctx context.Context, e *env, args []string) error {
			if err := noArgs(args); err != nil {
				return err
			}
			var progress io.Writer
			if !*asJSON && e.stderrIsTTY {
				progress = e.stderr
			}
			notice := func(s string) { fmt.Fprintln(e.stderr, "kvoffload demo: "+s) }
			rep, err := runDemo(ctx, cfg, progress, notice)
			if rep != nil {
				var werr error
				if *asJSON {
					werr = writeJSON(e.stdout, rep)
				} else {
					werr = rep.print(e.stdout)
				}
				err = errors.Join(err, werr)
			}
			return err
		}
	},
}

// demoConfig is what the demo runs with.
type demoConfig struct {
	duration   time.Duration
	requests   int
	poolBytes  int64
	gpuBlocks  int
	layoutName string
	layoutKind offload.LayoutKind
	backend    offload.Backend
	device     int
	pinning    string
	policy     offload.Policy
	seed       uint64
	verify     bool
	// prefaultThreads is the engine's Config.PrefaultThreads (0: its default).
	prefaultThreads int
	// prefaultNice is the engine's Config.PrefaultNice (0: its default).
	prefaultNice int
	// metricsAddr and eventsAddr: --metrics and --events (demo_observe.go).
	metricsAddr, eventsAddr string
	// diskDir and diskBytes: --disk and --disk-bytes (the engine's Config.Disk).
	diskDir   string
	diskBytes int64
	// diskRemove: --disk-remove-records (DiskConfig.RemoveRecords).
	diskRemove string
	// redis: --redis (the engine's Config.Cluster; demo_cluster.go), with
	// --redis-user and --redis-tls.
	redis     string
	redisUser string
	redisTLS  bool
	// redisTLSCA and redisTLSName: --redis-tls-ca and --redis-tls-name.
	redisTLSCA, redisTLSName string
	// connect: --connect, the node's socket (offload.Dial).
	connect string

	// diskFaults is a test hook: internal/tier/disk's fault seam for the host
	// backend's disk tier (hostsim.Options.DiskFaults).
	diskFaults func(op hostsim.DiskFaultOp, dir string) error
	// simDelay is a test hook: the host backend's copies each wait this
	// long (hostsim.Options' MinDelay and MaxDelay).
	simDelay time.Duration
	// nodeStep is a test hook: with --connect, it runs on the serving
	// goroutine right after a Store is submitted ("store") and before a
	// Load with a lease ("load"), where the tests restart the node.
	nodeStep func(step string)
	// corruptLoads is a test hook: the first corruptLoads loaded blocks
	// get one byte changed before they are verified.
	corruptLoads int
	// regionBytes is the engine's Config.RegionBytes and FirstRegionBytes (0: the defaults).
	regionBytes int64
	// afterRequest, when set, runs after each request with the engine and
	// the request's keys (the soak's Trim, Delete and Clear); an error ends
	// the run.
	afterRequest func(eng *offload.Engine, keys []offload.Key) error
}

func defaultDemoConfig() demoConfig {
	return demoConfig{duration: 30 * time.Second, poolBytes: 1 << 30, layoutName: "8b",
		layoutKind: offload.LayoutLayerSeparate, backend: offload.BackendAuto, pinning: "auto",
		policy: offload.PolicyLRU, seed: 1, verify: true}
}

// check validates the flags that runDemo does not hand to the engine.
func (c demoConfig) check() (modelShape, error) {
	shape, ok := layoutPresets[c.layoutName]
	switch {
	case !ok:
		return shape, fmt.Errorf("%w: --layout %q must be one of %s", errUsage, c.layoutName, presetNames())
	case c.duration < 0:
		return shape, fmt.Errorf("%w: --duration %v must not be negative", errUsage, c.duration)
	case c.requests < 0:
		return shape, fmt.Errorf("%w: --requests %d must not be negative", errUsage, c.requests)
	case c.duration == 0 && c.requests == 0:
		return shape, fmt.Errorf("%w: --duration 0 needs a --requests bound", errUsage)
	case c.gpuBlocks < 0:
		return shape, fmt.Errorf("%w: --gpu-blocks %d must not be negative", errUsage, c.gpuBlocks)
	case c.device < 0:
		return shape, fmt.Errorf("%w: --device %d must not be negative", errUsage, c.device)
	case c.poolBytes <= 0:
		return shape, fmt.Errorf("%w: --pool-bytes %d must be positive", errUsage, c.poolBytes)
	case c.prefaultThreads < 0:
		return shape, fmt.Errorf("%w: --prefault-threads %d must not be negative (0: the default)", errUsage, c.prefaultThreads)
	case c.diskBytes < 0:
		return shape, fmt.Errorf("%w: --disk-bytes %d must not be negative", errUsage, c.diskBytes)
	case (c.diskBytes > 0 || c.diskRemove != "") && c.diskDir == "":
		return shape, fmt.Errorf("%w: --disk-bytes and --disk-remove-records need --disk", errUsage)
	case c.connect != "" && (c.diskDir != "" || c.redis != ""):
		return shape, fmt.Errorf("%w: --connect: the disk and cluster tiers are not available through a node", errUsage)
	}
	if _, err := redisAddrs(c.redis); err != nil {
		return shape, err
	}
	if c.diskDir != "" && slices.Contains(diskDirs(c.diskDir), "") {
		return shape, fmt.Errorf("%w: --disk %q: want DIR[,DIR...] with no empty name", errUsage, c.diskDir)
	}
	if c.redis == "" && (c.redisUser != "" || c.redisTLS || c.redisTLSCA != "" || c.redisTLSName != "") {
		return shape, fmt.Errorf("%w: --redis-user and --redis-tls[-ca|-name] need --redis", errUsage)
	}
	switch c.backend {
	case offload.BackendAuto, offload.BackendCUDA, offload.BackendHost:
	default:
		return shape, fmt.Errorf("%w: --backend %q must be auto, cuda or host", errUsage, c.backend)
	}
	switch c.pinning {
	case "auto", string(offload.PinMlock), string(offload.PinNone):
	default:
		return shape, fmt.Errorf("%w: --pinning %q must be auto, mlock or none", errUsage, c.pinning)
	}
	switch c.policy {
	case offload.PolicyTinyLFU, offload.PolicyLRU:
	default:
		return shape, fmt.Errorf("%w: --policy %q must be tinylfu or lru", errUsage, c.policy)
	}
	return shape, nil
}

// plan checks c (check, and that the pool holds a block) and returns the
// GPU cache's layout and the number of blocks the pool holds.
func (c demoConfig) plan() (cacheLayout, int64, error) {
	shape, err := c.check()
	if err != nil {
		return cacheLayout{}, 0, err
	}
	lay := cacheLayout{shape: shape, kind: c.layoutKind}
	blockBytes := lay.blockBytes()
	if c.poolBytes < blockBytes {
		return cacheLayout{}, 0, fmt.Errorf("%w: --pool-bytes %s cannot hold one %s block of layout %s", errUsage, formatSize(c.poolBytes), formatSize(blockBytes), c.layoutName)
	}
	poolBlocks := c.poolBytes / blockBytes
	lay.blocks = c.gpuBlocks
	if lay.blocks == 0 {
		lay.blocks = int(max(poolBlocks/4, 16))
	}
	if err := checkLayout(lay); err != nil {
		return cacheLayout{}, 0, err
	}
	return lay, poolBlocks, nil
}

// demoRun is one demo in progress: the engine, the cache memory, the
// serving stack's view of its GPU cache and the counters.
type demoRun struct {
	cfg   demoConfig
	eng   *offload.Engine
	mem   kvMemory
	cache *gpuCache
	ns    string
	rep   *demoReport

	storeLat, loadLat []time.Duration
	corrupted         int
	lastKeys          []offload.Key // the keys of the request served last
	clusterPromoted   int64         // blocks Prefetch promoted (--redis)
	notice            func(string)
	nodeDown          bool // --connect: the last op met the node gone (nodeGone)
}

// runDemo runs the demo and returns its report; the report is returned
// with errVerification too. progress, when not nil, gets a progress bar
// (and a spinner on the engine's start and close when they take seconds);
// notice gets one-line notes (backend fallback, pinning).
func runDemo(ctx context.Context, cfg demoConfig, progress io.Writer, notice func(string)) (*demoReport, error) {
	lay, poolBlocks, err := cfg.plan()
	if err != nil {
		return nil, err
	}
	shape, blockBytes := lay.shape, lay.blockBytes()

	// The CUDA driver binds contexts to OS threads: the serving loop keeps
	// its thread.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()

	r := &demoRun{cfg: cfg, ns: "kvoffload-demo/" + cfg.layoutName + "/" + string(cfg.layoutKind), notice: notice}
	sp := startStep(progress, fmt.Sprintf("starting the engine (%s pool, %s backend)", formatSize(cfg.poolBytes), cfg.backend))
	opened, err := openDemo(cfg, lay, notice)
	sp.end()
	if err != nil {
		return nil, err
	}
	if err := diskTierError(cfg, opened.eng.Stats()); err != nil {
		return nil, errors.Join(err, opened.close())
	}
	r.eng, r.mem = opened.eng, opened.mem
	if err := observe(opened, cfg, notice); err != nil {
		return nil, errors.Join(err, opened.close())
	}
	defer func() {
		sp := startStep(progress, "closing the engine")
		err = errors.Join(err, opened.close())
		sp.end()
	}()

	r.cache = newGPUCache(lay.blocks)
	name, reason := r.eng.Backend()
	if opened.reason != "" {
		reason = opened.reason
	}
	r.rep = &demoReport{Backend: name, BackendReason: reason, Layout: cfg.layoutName, LayoutKind: cfg.layoutKind,
		BlockBytes: blockBytes, GPUBlocks: lay.blocks, PoolBytes: cfg.poolBytes, Pinning: opened.pinning,
		Policy: cfg.policy, Verify: cfg.verify, Node: cfg.connect}

	gen, err := trace.New(traceConfig(cfg.seed, lay.blocks, int(poolBlocks), shape.TokensPerBlock))
	if err != nil {
		return nil, err
	}
	bar := newDemoBar(progress, cfg)
	start := time.Now()
	for {
		if ctx.Err() != nil {
			notice("interrupted: reporting what ran")
			r.rep.Interrupted = true
			break
		}
		if cfg.requests > 0 && r.rep.Requests >= cfg.requests {
			break
		}
		if cfg.duration > 0 && time.Since(start) >= cfg.duration {
			break
		}
		if err := r.serve(gen.Next()); err != nil {
			return r.finish(start, bar), err
		}
		if r.rep.FirstRequest == nil {
			first := r.rep.Blocks
			r.rep.FirstRequest = &first
		}
		if cfg.afterRequest != nil {
			if err := cfg.afterRequest(r.eng, r.lastKeys); err != nil {
				return r.finish(start, bar), err
			}
		}
		bar.update(r.rep, time.Since(start))
	}
	if cfg.diskDir != "" && ctx.Err() == nil {
		if err := r.drain(); err != nil {
			return r.finish(start, bar), err
		}
	}
	rep := r.finish(start, bar)
	switch {
	case rep.VerifyFailures > 0:
		return rep, fmt.Errorf("%w: %d of %d loaded blocks hold the wrong content (first: %s)", errVerification, rep.VerifyFailures, rep.Verified, rep.FirstFailure)
	case rep.Store.Failed+rep.Load.Failed > 0:
		return rep, fmt.Errorf("the engine reported %d failed stores and %d failed loads: %s", rep.Store.Failed, rep.Load.Failed, rep.FirstEngineError)
	}
	return rep, nil
}

// traceConfig shapes the trace to the caches: a request never needs more
// than half the GPU cache, and the conversations open at once hold about
// one and a half times what the GPU cache and the pool together hold, so
// that there are GPU hits, host hits and misses.
func traceConfig(seed uint64, gpuBlocks, poolBlocks, tpb int) trace.Config {
	maxBlocks := max(gpuBlocks/2, 4)
	c := trace.Default
	c.Seed = seed
	c.SystemPrompts = 16
	c.SystemTokens = tpb * max(1, maxBlocks/8)
	c.TurnTokens = tpb * max(1, maxBlocks/32)
	c.DocumentTokens = tpb * max(1, maxBlocks/2)
	c.ActiveConversations = min(max(12*(gpuBlocks+poolBlocks)/max(gpuBlocks, 1), 8), 1024)
	return c
}

// opened is what openDemo set up.
type opened struct {
	// reason overrides the engine's reason for its backend (after a
	// fallback from auto, the engine was asked for host explicitly).
	reason  string
	eng     *offload.Engine
	mem     kvMemory
	pinning string
	close   func() error
}

// openDemo resolves the backend, allocates the GPU cache and starts the
// engine. With --backend auto it falls back to the host backend (with a
// notice) when the CUDA driver, the device, or the engine's CUDA backend is
// unavailable.
func openDemo(cfg demoConfig, lay cacheLayout, notice func(string)) (*opened, error) {
	if cfg.backend != offload.BackendHost {
		o, err := openCUDADemo(cfg, lay)
		if err == nil {
			return o, nil
		}
		if cfg.backend == offload.BackendCUDA || !errors.Is(err, offload.ErrNoDriver) {
			return nil, err
		}
		notice("CUDA unavailable, using the host backend: " + err.Error())
		o, herr := openHostDemo(cfg, lay, notice)
		if herr != nil {
			return nil, herr
		}
		o.reason = "auto: CUDA unavailable (" + err.Error() + ")"
		return o, nil
	}
	return openHostDemo(cfg, lay, notice)
}

func engineConfig(cfg demoConfig, lay cacheLayout, backend offload.Backend) offload.Config {
	ec := offload.Config{PoolBytes: cfg.poolBytes, StagingBytes: -1, Layout: lay.spec(), Backend: backend,
		Device: cfg.device, Policy: cfg.policy, Namespace: "kvoffload-demo", RegionBytes: cfg.regionBytes, FirstRegionBytes: cfg.regionBytes,
		PrefaultThreads: cfg.prefaultThreads, PrefaultNice: cfg.prefaultNice}
	if cfg.diskDir != "" {
		n := cfg.diskBytes
		if n == 0 {
			n = 4 * cfg.poolBytes
		}
		// A graceful shutdown's pool goes to disk (after the GPU cache's
		// blocks, see drain): the next run on the directory finds it.
		ec.Disk = &offload.DiskConfig{Dirs: diskDirs(cfg.diskDir), CapacityBytes: n, WriteBackOnClose: true}
		if cfg.diskRemove != "" {
			ec.Disk.RemoveRecords = diskDirs(cfg.diskRemove)
		}
	}
	ec.Cluster = clusterConfig(cfg)
	if cfg.connect != "" {
		// The node keeps one layout per namespace: one per geometry.
		ec.Namespace = "kvoffload-demo/" + cfg.layoutName + "/" + string(cfg.layoutKind)
	}
	return ec
}

// newDemoEngine is offload.New, or offload.Dial with --connect.
func newDemoEngine(cfg demoConfig, ec offload.Config) (*offload.Engine, error) {
	if cfg.connect != "" {
		return offload.Dial(cfg.connect, ec)
	}
	return offload.New(ec)
}

func openCUDADemo(cfg demoConfig, lay cacheLayout) (*opened, error) {
	drv, err := cuda.Load()
	if err != nil {
		return nil, err
	}
	n, err := drv.DeviceCount()
	if err != nil {
		return nil, fmt.Errorf("%w: counting devices: %w", offload.ErrNoDriver, err)
	}
	if cfg.device >= n {
		return nil, fmt.Errorf("%w: --device %d asked for, the driver sees %d device(s)", offload.ErrNoDriver, cfg.device, n)
	}
	mem, err := newCUDAMemory(drv, cfg.device, lay)
	if err != nil {
		return nil, err
	}
	eng, err := newDemoEngine(cfg, engineConfig(cfg, mem.layout(), offload.BackendCUDA))
	if err != nil {
		return nil, errors.Join(err, mem.close())
	}
	return &opened{eng: eng, mem: mem, pinning: "cuMemHostRegister", close: func() error {
		return errors.Join(eng.Close(), mem.close())
	}}, nil
}

func openHostDemo(cfg demoConfig, lay cacheLayout, notice func(string)) (*opened, error) {
	pin := offload.HostPinning(cfg.pinning)
	if pin == "auto" {
		pin = offload.PinNone
		var lim unix.Rlimit
		if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim); err == nil {
			if lim.Cur == unix.RLIM_INFINITY || lim.Cur >= uint64(cfg.poolBytes) {
				pin = offload.PinMlock
			} else {
				notice(fmt.Sprintf("pinning none: RLIMIT_MEMLOCK is %s, below the %s pool (raise ulimit -l to mlock it)", formatSize(int64(min(lim.Cur, math.MaxInt64))), formatSize(cfg.poolBytes)))
			}
		}
	}
	sim, err := hostsim.NewGPU(hostsim.Options{Seed: int64(cfg.seed), DiskFaults: cfg.diskFaults, MinDelay: cfg.simDelay, MaxDelay: cfg.simDelay})
	if err != nil {
		return nil, err
	}
	mem, err := newHostMemory(sim, lay)
	if err != nil {
		return nil, errors.Join(err, sim.Close())
	}
	ec := engineConfig(cfg, mem.layout(), offload.BackendHost)
	ec.HostPinning = pin
	var eng *offload.Engine
	if cfg.connect != "" {
		eng, err = hostsim.Dial(cfg.connect, ec, sim)
	} else {
		eng, err = hostsim.NewEngine(ec, sim)
	}
	if err != nil {
		return nil, errors.Join(err, mem.close(), sim.Close())
	}
	return &opened{eng: eng, mem: mem, pinning: "host " + string(pin), close: func() error {
		return errors.Join(eng.Close(), mem.close(), sim.Close())
	}}, nil
}

// serve runs one request: GPU prefix hits; a lookup in the host pool (with
// a lease); GPU blocks for the rest, evicting least recently used blocks,
// which are stored first (and waited for: they are about to be
// overwritten); a load of the prefix the pool holds; a recompute of the
// rest; verification of what was loaded.
func (r *demoRun) serve(req trace.Request) error {
	tpb := r.mem.layout().shape.TokensPerBlock
	keys, err := offload.ChainKeys(r.ns, offload.Key{}, req.Tokens, tpb)
	if err != nil {
		return err
	}
	r.rep.Requests++
	r.lastKeys = keys
	if len(keys) > r.cache.blocks() {
		keys = keys[:r.cache.blocks()]
		r.rep.RequestsTruncated++
	}
	if len(keys) == 0 {
		return nil
	}
	g := r.cache.prefix(keys)
	r.cache.touchPrefix(keys[:g])
	r.rep.Blocks.Total += int64(len(keys))
	r.rep.Blocks.GPUHits += int64(g)
	rest := keys[g:]
	if len(rest) == 0 {
		return nil
	}
	for _, k := range rest {
		// A cached key past the prefix cannot happen with prefix-closed
		// LRU; if it did, the block is given up rather than held twice.
		if id, ok := r.cache.byKey[k]; ok {
			r.cache.drop(id)
		}
	}
	lr, err := r.eng.Lookup(rest, offload.LookupOptions{Lease: true})
	if err != nil {
		return err
	}
	ids, victims, err := r.cache.alloc(len(rest), g)
	if err != nil {
		return errors.Join(err, releaseLease(lr.Lease))
	}
	if err := r.store(victims); err != nil {
		return errors.Join(err, releaseLease(lr.Lease))
	}
	// The host prefix (leased) and the disk prefix after it, which the
	// Load promotes.
	n := lr.Hits + lr.DiskHits
	// With --redis, the keys past those are prefetched from the cluster
	// (and disk): the prefix promoted into the pool loads too.
	c, err := r.prefetchCluster(rest, n)
	if err != nil {
		return errors.Join(err, releaseLease(lr.Lease))
	}
	n += c
	loaded, missing, err := r.load(rest[:n], ids[:n], lr.Lease)
	if err != nil {
		return err
	}
	var recIDs []int
	var recKeys []offload.Key
	for _, i := range missing {
		recIDs, recKeys = append(recIDs, ids[i]), append(recKeys, rest[i])
	}
	recIDs, recKeys = append(recIDs, ids[n:]...), append(recKeys, rest[n:]...)
	t := time.Now()
	if err := r.mem.recompute(recIDs, recKeys); err != nil {
		return fmt.Errorf("recomputing %d blocks: %w", len(recIDs), err)
	}
	r.rep.RecomputeSeconds += time.Since(t).Seconds()
	for _, i := range loaded {
		switch {
		case i < lr.Hits:
			r.rep.Blocks.HostHits++
		case i < lr.Hits+lr.DiskHits:
			r.rep.Blocks.DiskHits++
		default:
			r.rep.Blocks.ClusterHits++
		}
	}
	r.rep.Blocks.Misses += int64(len(recIDs))
	if err := r.verify(loaded, ids, rest); err != nil {
		return err
	}
	for i := len(rest) - 1; i >= 0; i-- {
		r.cache.insert(ids[i], rest[i])
	}
	r.cache.touchPrefix(keys[:g])
	return nil
}

// cpuTime is the process's user plus system CPU time.
func cpuTime() time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// drain stores every block of the GPU cache (as a serving stack offloads
// its cache at a graceful shutdown), least recent first, in batches of a
// request's size, so that Close writes them to disk with the pool.
func (r *demoRun) drain() error {
	var vs []victim
	for id := r.cache.tail; id >= 0; id = r.cache.prev[id] {
		vs = append(vs, victim{id: id, key: r.cache.keyOf[id]})
	}
	for len(vs) > 0 {
		n := min(len(vs), max(1, r.cache.blocks()/2))
		if err := r.store(vs[:n]); err != nil {
			return err
		}
		r.rep.Drained += int64(n)
		vs = vs[n:]
	}
	return nil
}

// verify checks the loaded blocks (indices into ids and keys), timed apart
// from the copies.
func (r *demoRun) verify(loaded, ids []int, keys []offload.Key) error {
	if !r.cfg.verify || len(loaded) == 0 {
		return nil
	}
	vIDs := make([]int, len(loaded))
	vKeys := make([]offload.Key, len(loaded))
	for j, i := range loaded {
		vIDs[j], vKeys[j] = ids[i], keys[i]
		if r.corrupted < r.cfg.corruptLoads {
			if err := r.mem.corrupt(ids[i]); err != nil {
				return err
			}
			r.corrupted++
		}
	}
	t := time.Now()
	bad, err := r.mem.verify(vIDs, vKeys)
	r.rep.VerifySeconds += time.Since(t).Seconds()
	if err != nil {
		return fmt.Errorf("verifying %d blocks: %w", len(vIDs), err)
	}
	r.rep.Verified += int64(len(vIDs))
	r.rep.VerifyFailures += int64(len(bad))
	if len(bad) == 0 {
		return nil
	}
	if r.rep.FirstFailure == "" {
		r.rep.FirstFailure = fmt.Sprintf("GPU block %d, key %s", vIDs[bad[0]], vKeys[bad[0]])
	}
	// A wrong block is not served: its pool copy is dropped and the block
	// recomputed, so one failure is counted once, not again each time the
	// block would travel.
	badIDs := make([]int, len(bad))
	badKeys := make([]offload.Key, len(bad))
	for j, i := range bad {
		badIDs[j], badKeys[j] = vIDs[i], vKeys[i]
	}
	if _, err := r.eng.Delete(badKeys); err != nil {
		return err
	}
	return r.mem.recompute(badIDs, badKeys)
}

// finish fills in the report's totals from the run and the engine's stats.
func (r *demoRun) finish(start time.Time, bar *demoBar) *demoReport {
	bar.finish()
	rep := r.rep
	rep.Seconds = time.Since(start).Seconds()
	st := r.eng.Stats()
	rep.PinnedBytes, rep.UsedBytes = st.Pool.OwnedBytes, st.Pool.InUseBytes
	rep.EngineStoreBytes, rep.EngineLoadBytes = st.Copies.Store.Bytes, st.Copies.Load.Bytes
	rep.Evictions, rep.BounceCopies = st.Evictions, st.Copies.Bounced
	if r.cfg.diskDir != "" {
		rep.Disk = &diskReport{Dir: r.cfg.diskDir, Mode: st.Disk.Mode, Records: st.Disk.Records, Bytes: st.Disk.Bytes, Capacity: st.Disk.Capacity,
			Writes: st.Disk.Writes, WriteErrors: st.Disk.WriteErrors, Dropped: st.Disk.Dropped, NotAdmitted: st.Disk.NotAdmitted,
			Hits: st.Disk.Hits, Misses: st.Disk.Misses, Corrupt: st.Disk.Corrupt}
	}
	rep.Cluster = r.clusterReportOf(st)
	r.nodeReport(st)
	for _, d := range []struct {
		dir *directionReport
		lat []time.Duration
	}{{&rep.Store, r.storeLat}, {&rep.Load, r.loadLat}} {
		d.dir.Bytes = d.dir.Blocks * rep.BlockBytes
		if d.dir.Seconds > 0 {
			d.dir.GBps = float64(d.dir.Bytes) / d.dir.Seconds / 1e9
		}
		d.dir.P50us, d.dir.P99us = quantileMicros(d.lat, 0.5), quantileMicros(d.lat, 0.99)
	}
	if moved := rep.Store.Blocks + rep.Load.Blocks; moved > 0 {
		rep.CPUMicrosPerBlock = rep.CPUSeconds * 1e6 / float64(moved)
	}
	return rep
}

// quantileMicros returns the q-quantile of d (nearest rank) in µs.
func quantileMicros(d []time.Duration, q float64) float64 {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	i := int(math.Ceil(q*float64(len(s)))) - 1
	return float64(s[min(max(i, 0), len(s)-1)]) / 1e3
}
