/*
 * kvoffload.h — the C ABI of libkvoffload.so, the KV-cache offload engine.
 *
 * Build:  go build -buildmode=c-shared -o build/libkvoffload.so ./capi
 *         (or capi/build.sh). Link with -lkvoffload, or dlopen it.
 *
 * Conventions
 *  - Every function but kvo_abi_version, kvo_version and kvo_last_error returns an int
 *    error code: KVO_OK (0) or one of the negative KVO_E* codes below. On
 *    error, kvo_last_error() returns a message naming the bad value and the
 *    limit it broke; output parameters are left untouched and nothing is
 *    half done (a failed call leaves no partial state).
 *  - kvo_last_error() is per thread: it is the message of the most recent
 *    failed call made by the calling thread, valid until that thread's next
 *    kvo_* call. Calls that succeed clear it to "".
 *  - Handles (kvo_engine_t, kvo_op_t, kvo_lease_t) are opaque non-zero
 *    integers, not pointers, never reused within a process. A bad handle is
 *    an error code, never a crash:
 *      - a destroyed engine's handle: KVO_ECLOSED, from every call taking
 *        an engine (kvo_engine_destroy included);
 *      - a released op's or lease's handle (a lease handed to a kvo_load
 *        that succeeded counts as released): KVO_ERELEASED, from every call
 *        taking an op or a lease (kvo_op_release and kvo_lease_release
 *        included);
 *      - 0, a value never issued, or a handle of another kind (an engine
 *        handle passed as an op): KVO_EINVAL.
 *    Ops and leases outlive their engine: after kvo_engine_destroy they are
 *    still valid handles (kvo_op_wait, kvo_op_outcomes, the releases work)
 *    and must still be released.
 *  - Keys are 16 bytes each, passed packed: n keys are 16*n bytes.
 *  - CUDA objects cross as plain integers: device pointers as uint64_t,
 *    CUstream and CUevent as uintptr_t (0 means none / the legacy default
 *    stream where a stream is expected).
 *  - Every function is safe to call from several threads at once, on the
 *    same engine or different ones. Pointers passed in are read or written
 *    only during the call, never kept; CUDA events passed in (after_event,
 *    signal_event) are used until the op is done.
 *  - Asynchrony: kvo_store and kvo_load return at once with an op, before
 *    its copies are enqueued (a load with a signal_event returns once they
 *    are); the caller waits on the CPU (kvo_op_wait / kvo_op_query) or on
 *    the GPU (kvo_op_stream_wait, kvo_op_event, kvo_op_layer_event, which
 *    block the CPU only until the event is recorded). No call waits for
 *    copies or for growth except kvo_op_wait and kvo_wait_grown (each for
 *    at most its timeout), kvo_op_release of an op not yet done, kvo_trim,
 *    kvo_engine_destroy and, on the host backend, kvo_op_stream_wait.
 *
 * The Go runtime inside a non-Go process
 *  - Loading the library starts the Go runtime (its own threads). The
 *    number running Go code at once (GOMAXPROCS) is the GOMAXPROCS
 *    environment variable's value when it is set at load, else min(CPUs
 *    available to the process, 8): the library caps it itself and writes
 *    no environment variable. kvo_stats_json reports it ("go_maxprocs").
 *  - Go installs handlers only for synchronous signals (SIGSEGV, SIGBUS,
 *    SIGFPE) and SIGPIPE, chaining to handlers that were there before;
 *    handlers already installed for other signals (SIGINT, SIGTERM...) are
 *    kept, with SA_ONSTACK added. A handler installed after the load must
 *    use SA_ONSTACK (CPython's signal.signal does), or be kept off the Go
 *    runtime's threads: load the library with asynchronous signals blocked
 *    in the loading thread; the runtime's threads inherit that mask and
 *    keep those signals blocked for good, so the kernel delivers them to the
 *    program's own threads. The Python package does this.
 *  - fork(2) after the load leaves the child with a Go runtime whose threads
 *    are gone. Every call made in a child returns KVO_EFORK (checked in C,
 *    before any Go code runs); load the library in the child itself (spawn,
 *    not fork) if the child needs an engine.
 */
#ifndef KVOFFLOAD_H
#define KVOFFLOAD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The version of this ABI. A caller checks kvo_abi_version() ==
 * KVO_ABI_VERSION before any other call; a library of another version
 * must not be used. It changes only on an incompatible change:
 *   1  the first release;
 *   2  kvo_store gained parent and parents (before after_event);
 *   3  one mode: kvo_store and kvo_load return before their copies are
 *      enqueued, and kvo_op_event, kvo_op_layer_event and
 *      kvo_op_stream_wait block until the event is recorded (the copies
 *      it follows enqueued, not finished); the early_events config key
 *      and stats fields are gone;
 *   4  kvo_stats_json nests the statistics by concern, as offload.Stats
 *      does: objects "pool" (memory, regions, growth, slots: e.g.
 *      "pool":{"regions":...}), "copies" ("store", "load" and the CUDA
 *      copy counters), "disk", "cluster" and "node", whose keys drop
 *      their old prefix ("disk_hits" is "disk":{"hits":...}); lookups,
 *      outcomes, policy, head-range and prefetch counters stay at the top;
 *      the config key greedy_stores (a benchmark comparison) is gone. */
#define KVO_ABI_VERSION 4

/* Error codes. */
#define KVO_OK          0
#define KVO_EINVAL     -1  /* bad argument: NULL pointer, length, block id, key, JSON, a handle never issued or of another kind */
#define KVO_ECLOSED    -2  /* the engine handle was destroyed (kvo_engine_destroy) */
#define KVO_EBUSY      -3  /* the queue for in-flight room is full (kvo_load) */
#define KVO_ENODRIVER  -4  /* the CUDA backend was asked for but libcuda/a device is missing */
#define KVO_ENOMEM     -5  /* the machine cannot hold the pool, or no staging room is left */
#define KVO_ERELEASED  -6  /* the op or lease handle was already released (a lease: or taken over by kvo_load) */
#define KVO_ECAPTURING -7  /* the after_stream of a store is capturing a CUDA graph */
#define KVO_EFAIL      -8  /* a copy or the driver failed; see kvo_last_error */
#define KVO_ETIMEOUT   -9  /* kvo_op_wait: the timeout passed before the op was done */
#define KVO_EFORK     -10  /* called in a forked child of the process that loaded the library */
#define KVO_ENOTDONE  -11  /* kvo_op_outcomes: the op is not done yet */
#define KVO_EGROWTH   -12  /* kvo_wait_grown: background growth of the pool stopped on an error */
#define KVO_EUNAVAILABLE -13 /* an engine of kvo_engine_connect: its node is unreachable (kvo_load; kvo_engine_connect) */

/* Per-block outcomes written by kvo_op_outcomes. */
#define KVO_OUTCOME_PENDING            0
#define KVO_OUTCOME_STORED             1
#define KVO_OUTCOME_ALREADY_PRESENT    2
#define KVO_OUTCOME_REFUSED_FULL       3
#define KVO_OUTCOME_REFUSED_BUSY       4
#define KVO_OUTCOME_REFUSED_ADMISSION  5
#define KVO_OUTCOME_FAILED             6
#define KVO_OUTCOME_LOADED             7
#define KVO_OUTCOME_MISSING            8
#define KVO_OUTCOME_CANCELLED          9

#define KVO_KEY_BYTES 16

typedef uint64_t kvo_engine_t;
typedef uint64_t kvo_op_t;
typedef uint64_t kvo_lease_t;

/* KVO_ABI_VERSION of the library actually loaded. Never fails. */
int kvo_abi_version(void);

/* The message of the calling thread's last failed call ("" if none).
 * Never NULL; valid until the thread's next kvo_* call. */
const char* kvo_last_error(void);

/* The library's release version ("0.1.0"; internal/version/VERSION), the
 * same as the Python package's __version__ and `kvoffload version`. It says
 * which build this is; KVO_ABI_VERSION says whether it can be used. Never
 * NULL, never fails; a static string. */
const char* kvo_version(void);

/* Creates an engine from a JSON object with the fields of Go's
 * offload.Config (snake_case: "pool_bytes", "backend", "namespace",
 * "layout": {"kind", "layers", "kv_heads", "head_dim", "dtype_bytes",
 * "tokens_per_block", "num_blocks", "layer_tensors": [{"k","v","stride"}],
 * "base", "stride", "model_kv_heads", "head_first", "order"},
 * "partial_timeout", ...). A tensor-parallel rank gives its heads as
 * "kv_heads" of the model's "model_kv_heads" from "head_first", and the
 * GPU order ("token-major" or "head-major"): every TP size then shares the
 * blocks, and the namespace must not name the rank or the TP size.
 * Unknown fields are refused (KVO_EINVAL). On the
 * host backend a layout without tensors is allocated in the engine's
 * simulated GPU (see kvo_sim_write), whose random copy delays an optional
 * "sim": {"seed", "min_delay_ns", "max_delay_ns"} sets. A bad field value
 * (a NUMA node the machine lacks, a namespace with a NUL byte, which
 * kvo_clear could not name) is KVO_EINVAL. */
int kvo_engine_create(const char* config_json, kvo_engine_t* out);

/* Creates an engine whose block index and host pool are those of the node
 * serving the unix socket at socket (`kvoffload serve`; Go's offload.Dial),
 * shared with every other engine connected to it. config_json is
 * kvo_engine_create's; the pool fields (pool_bytes, region sizes, huge
 * pages, NUMA) are ignored, the disk and cluster tiers and
 * zero_on_release are refused (KVO_EINVAL). A layout without tensors and
 * a backend other than "host" makes a client without a GPU (a scheduler):
 * it may call kvo_lookup (leases included), kvo_lease_release,
 * kvo_delete, kvo_clear, kvo_stats_json, kvo_trim (the node's, for every
 * client), the event calls and kvo_engine_destroy; kvo_store and kvo_load
 * are KVO_EINVAL. While the node is unreachable kvo_lookup finds nothing,
 * kvo_store refuses its blocks busy, kvo_load is KVO_EUNAVAILABLE; the
 * engine reconnects by itself. No node at socket: KVO_EUNAVAILABLE; a node
 * serving the namespace with another layout: KVO_EINVAL. Destroy it with
 * kvo_engine_destroy. */
int kvo_engine_connect(const char* socket, const char* config_json, kvo_engine_t* out);

/* Closes the engine: refuses new calls, waits for copies in flight, unpins
 * and unmaps the pool, and frees the handle: every later call taking it
 * (this one included) returns KVO_ECLOSED. Ops and leases of the engine
 * stay valid handles (kvo_op_wait, kvo_op_outcomes, releases) and must
 * still be released. Every step of the destroy (the engine, its event
 * stream, its simulated GPU) runs even when one fails; the failure is
 * reported (KVO_EFAIL or the step's code) with the handle freed all the
 * same. */
int kvo_engine_destroy(kvo_engine_t engine);

/* Writes the engine's configuration with defaults filled in (and, on the
 * host backend, the simulated tensors' addresses) as JSON into buf (NUL-
 * terminated). "backend" is the backend in use ("host" or "cuda": "auto"
 * resolved) and "device" is always present (0 included); other zero-valued
 * optional fields may be left out. *needed gets the size including the NUL; if cap is smaller
 * nothing is written and KVO_EINVAL is returned. */
int kvo_engine_config_json(kvo_engine_t engine, char* buf, size_t cap, size_t* needed);

/* The longest prefix of keys (n keys, 16 bytes each) whose blocks are ready
 * in the pool: *hits. With lease != 0 and *hits > 0, *lease_out gets a
 * reader lease on those blocks (else 0); release it with kvo_lease_release
 * or hand it to kvo_load. lease_out may be NULL when lease == 0. */
int kvo_lookup(kvo_engine_t engine, const uint8_t* keys, size_t n, int lease,
               size_t* hits, kvo_lease_t* lease_out);

/* Copies GPU blocks block_ids[i] into the pool under keys[i],
 * asynchronously. Per-block outcomes come from kvo_op_outcomes once done.
 * Before overwriting the blocks, the caller's stream waits on the op
 * (kvo_op_stream_wait).
 *
 * parent, parents: where the keys hang in their sequences' chains, so that
 * a sequence stored over several calls (decode adds a block at a time)
 * stays one chain and eviction takes its tail, never its middle. At most
 * one may be non-NULL (both: KVO_EINVAL).
 *  - parent (16 bytes): the keys are one sequence's blocks in order and
 *    parent is the key of the block before keys[0]; keys[i-1] is the parent
 *    of keys[i]. 16 zero bytes, or parent and parents both NULL: keys[0]
 *    starts a sequence.
 *  - parents (16*n bytes): for a call holding blocks of several sequences,
 *    the parent of each key (16 zero bytes: the key starts a sequence). A
 *    key whose parent is refused in the same call is refused the same way.
 *    KVO_EINVAL when a key is its own parent or appears twice.
 *
 * after_event: a CUevent recorded on the caller's stream after the kernels
 * that wrote the blocks (0: none); the copies wait on its most recent
 * record at the time they are issued, which may be after kvo_store
 * returns: do not record it again or destroy it before the op is done
 * (kvo_op_query / kvo_op_wait), whether or not the op was released.
 * after_stream: the stream it was recorded on (0: unknown), refused with
 * KVO_ECAPTURING when capturing. */
int kvo_store(kvo_engine_t engine, const uint8_t* keys, const int64_t* block_ids,
              size_t n, const uint8_t* parent, const uint8_t* parents,
              uintptr_t after_event, uintptr_t after_stream, kvo_op_t* op);

/* Copies the blocks stored under keys[i] into GPU blocks block_ids[i],
 * asynchronously. lease: from kvo_lookup (0: none); on success the load
 * takes it over and the lease handle is consumed (do not release it; using
 * it again is KVO_ERELEASED); on failure the caller still owns it. The
 * engine handle is checked first: a destroyed engine is KVO_ECLOSED, with
 * any lease. after_event: the destination blocks may be overwritten after
 * it (0: none); as for kvo_store, the copies wait on its most recent record
 * at the time they are issued: do not record it again or destroy it before
 * the op is done. per_layer != 0 records one event per layer
 * (kvo_op_layer_event). signal_event: a caller-owned CUevent also recorded
 * when the load completes (0: none); keep it valid until the op is done.
 * Fails fast with KVO_EBUSY when the queue is full. */
int kvo_load(kvo_engine_t engine, const uint8_t* keys, const int64_t* block_ids,
             size_t n, kvo_lease_t lease, uintptr_t after_event, int per_layer,
             uintptr_t signal_event, kvo_op_t* op);

/* Waits until the op is done. timeout_ns < 0: no limit; 0: poll. Returns
 * KVO_ETIMEOUT if it is not done in time (the op goes on), KVO_EFAIL if a
 * block's copy failed (outcomes are still readable), KVO_OK otherwise. */
int kvo_op_wait(kvo_op_t op, int64_t timeout_ns);

/* *done = 1 when the op is done, else 0. Never blocks. */
int kvo_op_query(kvo_op_t op, int* done);

/* Makes stream wait on the GPU until the op's copies are complete; the CPU
 * waits only until they are enqueued (see kvo_op_event). On the host
 * backend it waits on the CPU. */
int kvo_op_stream_wait(kvo_op_t op, uintptr_t stream);

/* The op's completion CUevent (0 on the host backend), valid until
 * kvo_op_release. It blocks until the engine has recorded the event (the
 * op's copies enqueued, not finished); KVO_EFAIL if the op failed first. */
int kvo_op_event(kvo_op_t op, uintptr_t* event);

/* The event recorded after layer's copies of a per-layer load (0 on the
 * host backend). It blocks until that event is recorded (layer 0's comes
 * first); KVO_EFAIL if the op failed first. KVO_EINVAL for a layer outside
 * [0, layers), a store, a load without per_layer, or a cross-layer
 * layout. */
int kvo_op_layer_event(kvo_op_t op, int layer, uintptr_t* event);

/* Writes the op's n per-block outcomes (KVO_OUTCOME_*) into out, in key
 * order. n must equal the op's number of blocks. KVO_ENOTDONE before the op
 * is done. */
int kvo_op_outcomes(kvo_op_t op, uint8_t* out, size_t n);

/* Gives the op's events back to the engine (waiting for the op to be done
 * first) and frees the handle. Every op must be released exactly once; a
 * second release returns KVO_ERELEASED, as does every other kvo_op_* call
 * on a released op. */
int kvo_op_release(kvo_op_t op);

/* Releases a lease taken by kvo_lookup and frees the handle. KVO_ERELEASED
 * for a lease already released or taken over by a kvo_load. Valid after
 * the engine was destroyed. */
int kvo_lease_release(kvo_lease_t lease);

/* The staging buffer called name (NUL-terminated), of exactly bytes bytes,
 * pinned at an address fixed until the engine is destroyed: *ptr is its
 * host address, *device_ptr (may be NULL) the address kernels and copies
 * use. Asking again for the same name and size gives the same buffer. */
int kvo_staging(kvo_engine_t engine, const char* name, uint64_t bytes,
                void** ptr, uint64_t* device_ptr);

/* Writes the engine's statistics (Go's offload.Stats: top-level counters
 * and the objects "pool", "copies", "disk", "cluster" and "node"; plus
 * "backend_reason": why the backend in use was picked, and "go_maxprocs":
 * the Go runtime's GOMAXPROCS) as a JSON object into buf
 * (NUL-terminated); *needed gets the size including the NUL. If cap is too
 * small nothing is written and KVO_EINVAL is returned (call again with
 * *needed bytes). */
int kvo_stats_json(kvo_engine_t engine, char* buf, size_t cap, size_t* needed);

/* Gives up to bytes of pinned pool memory back to the OS, waiting at most
 * timeout_ns (< 0: no limit) for copies in flight on the trimmed regions.
 * freed_bytes / pending_bytes (may be NULL): unmapped now / when their last
 * leases end. */
int kvo_trim(kvo_engine_t engine, uint64_t bytes, int64_t timeout_ns,
             uint64_t* freed_bytes, uint64_t* pending_bytes);

/* Removes n keys from the pool; *deleted (may be NULL) is how many were
 * present. */
int kvo_delete(kvo_engine_t engine, const uint8_t* keys, size_t n, size_t* deleted);

/* Removes every block stored in namespace (NUL-terminated; "" is the
 * default namespace); *cleared (may be NULL) is how many. */
int kvo_clear(kvo_engine_t engine, const char* namespace_, size_t* cleared);

/* The chained keys of the full blocks of tokens (n_tokens token ids):
 * key i = SHA-256(key i-1 || token ids of block i as little-endian uint32 ||
 * namespace)[0:16], key -1 = parent (16 bytes; NULL for 16 zero bytes).
 * A partial trailing block gets no key. out must hold out_cap keys
 * (16*out_cap bytes); *n_keys gets n_tokens / tokens_per_block, and if
 * that exceeds out_cap nothing is written and KVO_EINVAL is returned.
 * Needs no engine. */
int kvo_chain_keys(const uint8_t* namespace_, size_t namespace_len, const uint8_t* parent,
                   const uint32_t* tokens, size_t n_tokens, size_t tokens_per_block,
                   uint8_t* out, size_t out_cap, size_t* n_keys);

/* Background growth. kvo_engine_create returns once the pool's first
 * region is pinned; the rest is mapped and pinned region by region in the
 * background (the engine works meanwhile, with fewer slots).
 *
 * kvo_wait_grown waits until growth has ended, at most timeout_ns
 * (< 0: no limit; 0: poll), and returns:
 *   KVO_OK       the whole pool is pinned (and, on CUDA, the copy methods
 *                calibrated);
 *   KVO_ETIMEOUT growth goes on (or is paused) after timeout_ns;
 *   KVO_EGROWTH  growth stopped on an error (kvo_last_error says which,
 *                e.g. an mlock or cuMemHostRegister refused): the engine
 *                keeps the regions pinned so far and works with them;
 *                every later call returns KVO_EGROWTH again;
 *   KVO_ECLOSED  the engine was destroyed (or closed while growing).
 *
 * kvo_pause_growth stops pinning after the region in progress (the one
 * being prefetched is held, mapped but not pinned) until
 * kvo_resume_growth; both are idempotent and never block. */
int kvo_wait_grown(kvo_engine_t engine, int64_t timeout_ns);
int kvo_pause_growth(kvo_engine_t engine);
int kvo_resume_growth(kvo_engine_t engine);

/* Host backend only (KVO_EINVAL on CUDA): copy bytes into / out of the
 * engine's simulated GPU memory at a simulated device address (from
 * kvo_engine_config_json's layout). For tests and demos without a GPU.
 * n above INT64_MAX, a buffer wrapping the address space, or a range
 * outside the simulated memory: KVO_EINVAL. */
int kvo_sim_write(kvo_engine_t engine, uint64_t device_addr, const void* src, size_t n);
int kvo_sim_read(kvo_engine_t engine, uint64_t device_addr, void* dst, size_t n);

/* ---- Metrics and KV events ------------------------------------------------
 *
 * kvo_metrics_text writes the engine's metrics in the Prometheus text
 * exposition format (what `kvoffload demo --metrics` serves at /metrics;
 * the metric names are in the README), NUL-terminated; *needed gets the size
 * with the NUL; a smaller cap writes nothing and returns KVO_EINVAL.
 *
 * kvo_events_open subscribes the engine handle to the engine's KV events
 * (Go's Engine.Events): a bounded queue of buffer events (0: 65536) that
 * never slows the engine; events that find it full are dropped and counted
 * (kvo_events_dropped). One stream per engine handle (a second open is
 * KVO_EINVAL until kvo_events_close). kvo_events_poll never blocks: it
 * writes the events waiting (at most 4096) as a NUL-terminated JSON array
 * of objects in vLLM's field names:
 *   {"type": "BlockStored", "block_hashes": ["<32 hex digits>"],
 *    "parent_block_hash": "<hex>" (absent: none), "token_ids": [...],
 *    "block_size": n, "medium": "CPU"}
 *   {"type": "BlockRemoved", "block_hashes": ["<hex>"], "medium": "CPU"}
 *   {"type": "AllBlocksCleared"}
 * ("[]" when none). When cap is too small it writes nothing, returns
 * KVO_EINVAL with *needed, and keeps the batch for the next call. Stored
 * events come after the block is ready, removed ones after it left the
 * index. Calls on an engine without kvo_events_open are KVO_EINVAL.
 * From several threads: a poll or dropped racing kvo_events_close or
 * kvo_engine_destroy returns what the stream still held ("[]" once it is
 * empty), KVO_EINVAL (closed: no stream) or KVO_ECLOSED (destroyed); of
 * concurrent kvo_events_close calls one closes the stream and the others
 * return KVO_EINVAL; a kvo_events_open racing kvo_engine_destroy returns
 * KVO_OK (the stream then closed by the destroy) or KVO_ECLOSED. */
int kvo_metrics_text(kvo_engine_t engine, char* buf, size_t cap, size_t* needed);
int kvo_events_open(kvo_engine_t engine, int64_t buffer);
int kvo_events_poll(kvo_engine_t engine, char* buf, size_t cap, size_t* needed);
int kvo_events_dropped(kvo_engine_t engine, uint64_t* dropped);
int kvo_events_close(kvo_engine_t engine);

/* kvo_store with the token ids of the blocks stored: n_tokens = n ×
 * tokens_per_block (KVO_EINVAL otherwise), or 0 and tokens NULL for none.
 * They go into the blocks' BlockStored events, since routers hash tokens
 * themselves; the copy is the same as kvo_store's. */
int kvo_store_tokens(kvo_engine_t engine, const uint8_t* keys, const int64_t* block_ids, size_t n,
                     const uint8_t* parent, const uint8_t* parents, const uint32_t* tokens,
                     size_t n_tokens, uintptr_t after_event, uintptr_t after_stream, kvo_op_t* op_out);

/* Promotes the blocks of keys (a chain, as kvo_store takes it) that the
 * host pool lacks from the lower tiers into it (Engine.Prefetch): from the
 * disk tier (config "disk") what is there, then from the cluster tier
 * ("cluster") the rest, waiting for the cluster at most timeout_ns (0: the
 * cluster's "timeout"; negative: KVO_EINVAL). Later lookups and loads see
 * the promoted blocks; nothing is leased. What is missing, late or fails
 * its checks is a miss, not an error. *promoted = *from_disk +
 * *from_cluster (each may be NULL). Without a tier it promotes nothing. */
int kvo_prefetch(kvo_engine_t engine, const uint8_t* keys, size_t n, int64_t timeout_ns,
                 size_t* promoted, size_t* from_disk, size_t* from_cluster);

/* kvo_prefetch without the wait (PrefetchBestEffort): returns at once, the
 * promotion running on a thread of the engine, bounded by timeout_ns (0:
 * the cluster's "timeout" for the cluster, none for the disk). *started is
 * 1 when it started, 0 when it was refused because 4 such promotions were
 * running (stats "prefetch_refused"); may be NULL. The keys are copied. */
int kvo_prefetch_background(kvo_engine_t engine, const uint8_t* keys, size_t n, int64_t timeout_ns,
                            int* started);

#ifdef __cplusplus
}
#endif

#endif /* KVOFFLOAD_H */
