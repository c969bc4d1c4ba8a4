"""kvoffload as the prefix and swap tier of transformers' continuous batching.

    import kvoffload.integrations.transformers as kvt
    with kvt.attach(model, pool_bytes=64 << 30, model_id="meta-llama/Llama-3.1-8B") as tier:
        out = model.generate_batch(prompts, generation_config=gen_cfg,
                                   continuous_batching_config=ContinuousBatchingConfig(...))
    print(tier.stats())

attach(model) covers generate_batch, continuous_batching_context_manager
and init_continuous_batching on that model; attach(manager) covers one
ContinuousBatchingManager. transformers' own files are not changed.

Supported: transformers 5.17.x (SUPPORTED_VERSIONS), the version whose
continuous-batching internals this module was written against; any other
version is refused with UnsupportedVersionError (set
KVOFFLOAD_TF_UNTESTED=1 to try another at your own risk: the signature
check of every hooked method still runs). Models whose layers are all full
attention (one layer group); a model with sliding-window (or any other
non-full) layers is refused with UnsupportedModelError: transformers 5.17
turns prefix sharing off for such models, and its sliding-window blocks
are a rolling buffer that no token prefix names (see "Layer groups" below).
One process (no tensor parallelism). transformers' own CPU swap pool must
be off (cpu_offload_space=0, the default): kvoffload replaces it.

What it does, and where (transformers 5.17 has no plug-in point for any
of it: the cache, its BlockManager, the scheduler and the
OffloadingManager are built inside the manager's background thread from
fixed classes, so the hooks are instance attributes installed on those
objects at run time, when the manager creates its batch processor; the
classes and transformers' files are untouched):

1. Store behind the forward, so that eviction costs nothing:
   BlockManager.mark_shareable_blocks_as_complete is where transformers
   hashes the blocks a forward completed. The hook learns their keys and
   stores the ones not yet in the pool at once (one store, after= the
   compute stream, so the copies wait for the kernels that wrote them;
   the compute stream does not wait for the store). When
   BlockManager.has_enough_free_blocks is about to hand a cached complete
   block (ref_count 0, still hashed, popped last-freed-first) to another
   request, a block already in the pool costs nothing, a block whose store
   is still in flight makes the compute stream wait on that store alone,
   and any other block is stored then and waited on. write_behind=False
   stores at eviction only.

2. Prefix lookup past the GPU: PagedAttentionCache.search_prefix_match
   walks transformers' hash chain and stops at the first block not on the
   GPU. The hook continues the chain in kvoffload (its chained keys over
   the same token ids) and on the GPU (blocks there again after a gap are
   shared), takes a lease on the blocks found in kvoffload, allocates GPU
   blocks for what fits from the BlockManager, gives them transformers'
   hashes (so they join its GPU index and are shared from then on), loads them
   (ordered after the compute stream's queued work; per layer where the
   attention path allows: without CUDA graphs or compile, the cache's
   update() waits on each layer's event before reading that layer) and
   returns the longer prefix: the scheduler then computes only the rest.
   A prompt partly on the GPU, partly in kvoffload and partly new loads
   only the middle and computes only the new part. A waiting request is
   looked up at every scheduling step: one whose chain missed is not
   looked up again (no engine call, no hashing) until a store of the key
   it missed has landed in the pool or transformers' own match moved.

3. Swap on preemption: OffloadingManager._offload_to_cpu (called for the
   victims before their blocks are freed) stores each victim's blocks
   under their chained keys (blocks already in the pool, written behind,
   are not copied again; stores are never refused for bytes in flight),
   and its last, partly filled block under a key of its tokens chained to
   the last full block. It returns no request as
   "CPU-offloaded", so transformers requeues every victim as a new
   request of its prompt plus the tokens generated so far (its soft
   reset); when that request is scheduled, the prefix lookup above finds
   all its blocks (on the GPU or in kvoffload) including the partial one,
   and only its last token is computed again. transformers' static pinned
   pool is never allocated.

The hooks, each an instance attribute shadowing the method of that
name (HOOKED_SIGNATURES lists their parameters, checked at attach()):
  BlockManager.has_enough_free_blocks            store before eviction (1)
  BlockManager.mark_shareable_blocks_as_complete learns the key of each block
                                                 transformers completes
  PagedAttentionCache.search_prefix_match        the lookup (2)
  PagedAttentionCache.update                     per-layer waits (2), only
                                                 with per-layer loads
  Scheduler._infer_request_tokens                counts a loaded, partly
                                                 filled block as allocated (3)
  OffloadingManager._offload_to_cpu              the swap (3)
  ContinuousBatchingManager._create_batch_processor, and the model's
  init_continuous_batching                       where the tier attaches

Keys: kvoffload.chain_keys over the token ids (SHA-256, the same in every
process), in the namespace
"transformers-cb/<model id>/<dtype>/bs<block size>/kv<heads>x<head dim>/L<layers>/g<group>".
transformers' own per-process hashes stay the index of its GPU blocks;
the hook keeps, for each GPU block it saw completed, its key.

Layer groups: transformers groups layers by attention type; with sliding
window layers there are several groups, the cache's tensors hold blocks
of every group, and prefix sharing is off. Each group would need its own
namespace (group_namespace(ns, g) gives it: keys of group g never equal
those of another group) but a sliding-window group's blocks are a rolling
buffer whose contents are not named by a token prefix, so they cannot be
shared or resumed by key: such models are refused (UnsupportedModelError)
rather than half supported.
"""

import inspect
import itertools
import logging
import os
import threading
import time
import uuid
from collections import Counter, deque

from ..errors import KvoError
from ..keys import ZERO_KEY, block_key, chain_keys

logger = logging.getLogger("kvoffload.transformers")

# transformers (major, minor) versions whose continuous-batching internals
# this module hooks, checked on a GPU (bench/transformers_cb.py).
SUPPORTED_VERSIONS = ((5, 17),)
UNTESTED_ENV = "KVOFFLOAD_TF_UNTESTED"

# The methods the hooks wrap or call, with the parameter names of 5.17
# (after self). attach() checks them against the installed transformers.
HOOKED_SIGNATURES = {
    "BlockManager.has_enough_free_blocks": ("n_blocks",),
    "BlockManager.get_free_blocks": ("n_blocks", "last_block_id", "shareable", "group_id"),
    "BlockManager.mark_shareable_blocks_as_complete": ("num_complete_blocks", "allocated_blocks", "prompt_ids"),
    "BlockManager.compute_hash": ("parent_hash", "tokens", "group_id"),
    "BlockManager.uninitialize_unshared_block": ("block_id",),
    "PagedAttentionCache.search_prefix_match": ("request_id", "prompt_ids"),
    "PagedAttentionCache.update": ("key_states", "value_states", "layer_idx", "read_index", "write_index"),
    "Scheduler._infer_request_tokens": ("state", "request_ids_to_remove_from_waiting"),
    "OffloadingManager._offload_to_cpu": ("victims",),
    "ContinuousBatchingManager._create_batch_processor": (),
    "ContinuousMixin.init_continuous_batching": ("generation_config", "continuous_batching_config",
                                                 "workload_hints"),
}


class TransformersIntegrationError(KvoError):
    """Base of the errors of this integration."""


class UnsupportedVersionError(TransformersIntegrationError, RuntimeError):
    """The installed transformers is not a supported version, or a method
    the hooks need has another signature."""


class UnsupportedModelError(TransformersIntegrationError, ValueError):
    """The model's cache layout is not supported (sliding-window or other
    non-full-attention layers, tensor parallelism)."""


class UnsupportedConfigError(TransformersIntegrationError, ValueError):
    """The continuous batching configuration conflicts with the tier
    (transformers' own CPU swap pool on, block sharing off)."""


# ---- versions and signatures ----------------------------------------------

def parse_version(version):
    """(major, minor) of a version string such as "5.17.0" or "5.17.0.dev0"."""
    parts = str(version).split(".")
    try:
        return int(parts[0]), int("".join(itertools.takewhile(str.isdigit, parts[1])) or "x")
    except (IndexError, ValueError):
        raise UnsupportedVersionError(f"kvoffload: cannot read the transformers version {version!r}") from None


def check_version(version, env=None):
    """Raises UnsupportedVersionError unless version is a supported
    transformers version; with KVOFFLOAD_TF_UNTESTED=1 in env (default
    os.environ) an unsupported one only warns. Returns (major, minor)."""
    env = os.environ if env is None else env
    mm = parse_version(version)
    if mm in SUPPORTED_VERSIONS:
        return mm
    supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VERSIONS)
    msg = (f"kvoffload.integrations.transformers supports transformers {supported} (it hooks continuous batching's "
           f"BlockManager, PagedAttentionCache, Scheduler and OffloadingManager, whose internals change between "
           f"releases); transformers {version} is installed")
    if env.get(UNTESTED_ENV) == "1":
        logger.warning("%s; going on because %s=1", msg, UNTESTED_ENV)
        return mm
    raise UnsupportedVersionError(f"{msg}. Install transformers=={SUPPORTED_VERSIONS[-1][0]}."
                                  f"{SUPPORTED_VERSIONS[-1][1]}.*, or set {UNTESTED_ENV}=1 to try it anyway.")


def check_signatures(classes):
    """classes: {"BlockManager": cls, ...}. Raises UnsupportedVersionError
    naming every hooked method that is missing or whose parameters differ
    from HOOKED_SIGNATURES."""
    bad = []
    for qual, want in HOOKED_SIGNATURES.items():
        cname, meth = qual.split(".")
        cls = classes.get(cname)
        fn = getattr(cls, meth, None) if cls is not None else None
        if fn is None:
            bad.append(f"{qual} is missing")
            continue
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            bad.append(f"{qual}: no signature")
            continue
        got = tuple(p for p in params[1:] if p not in ("args", "kwargs"))
        if got != tuple(want):
            bad.append(f"{qual}{tuple(params[1:])}, want {tuple(want)}")
    if bad:
        raise UnsupportedVersionError("kvoffload: transformers' continuous batching is not the one this integration "
                                      "hooks: " + "; ".join(bad))


def transformers_classes():
    """The installed transformers' classes the hooks touch (imports it)."""
    from transformers.generation.continuous_batching import cache_manager, continuous_api, offloading_manager
    from transformers.generation.continuous_batching import cache as cache_mod
    from transformers.generation.continuous_batching import scheduler as sched_mod
    return {
        "BlockManager": cache_manager.BlockManager,
        "PagedAttentionCache": cache_mod.PagedAttentionCache,
        "Scheduler": sched_mod.Scheduler,
        "OffloadingManager": offloading_manager.OffloadingManager,
        "ContinuousBatchingManager": continuous_api.ContinuousBatchingManager,
        "ContinuousMixin": continuous_api.ContinuousMixin,
    }


def check_transformers(env=None):
    """Checks the installed transformers (version and hooked signatures);
    returns its version string."""
    import transformers
    check_version(transformers.__version__, env=env)
    check_signatures(transformers_classes())
    return transformers.__version__


# ---- layer groups and namespaces ------------------------------------------

def layer_groups(config):
    """The layer groups transformers 5.17 makes (group_layers_by_attn_type):
    (groups as lists of layer indices, their attention types)."""
    from math import gcd
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        t = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
        layer_types = [t] * config.num_hidden_layers
    by_type = {}
    for i, t in enumerate(layer_types):
        by_type.setdefault(t, []).append(i)
    size = gcd(*[len(v) for v in by_type.values()])
    groups = []
    for idx in by_type.values():
        for i in range(0, len(idx), size):
            groups.append(idx[i:i + size])
    return groups, [layer_types[g[0]] for g in groups]


def check_model_config(config):
    """Raises UnsupportedModelError for a model with any layer that is not
    full attention (sliding window, chunked, ...)."""
    groups, types = layer_groups(config)
    other = sorted({t for t in types if t != "full_attention"})
    if other:
        layers = [l for g, t in zip(groups, types) if t != "full_attention" for l in g]
        raise UnsupportedModelError(
            f"kvoffload: this model has {', '.join(other)} layers ({len(layers)} of "
            f"{sum(len(g) for g in groups)}: {layers[:8]}{'...' if len(layers) > 8 else ''}), in {len(groups)} layer "
            "groups: the transformers tier supports models whose layers are all full attention. transformers "
            "itself turns prefix sharing off for such models, and a sliding-window group's blocks are a rolling "
            "buffer that no token prefix names, so they can be neither shared nor resumed by key.")
    return groups, types


def check_no_cuda_graphs(use_cuda_graph):
    """Raises UnsupportedConfigError when transformers' CUDA graphs are on
    (True, or a tuple with any True; None, transformers' automatic choice,
    is checked again on the batch processor, where it is resolved). A
    replayed graph reads the cache without the per-layer waits and
    orders its kernels by the graph, not by the stream waits the tier puts
    on the compute stream before a load's blocks are read; that ordering
    is not checked on a GPU, so the tier refuses rather than risk a read
    of a block still being copied."""
    on = any(bool(x) for x in use_cuda_graph) if isinstance(use_cuda_graph, (tuple, list)) else use_cuda_graph is True
    if on:
        raise UnsupportedConfigError(
            f"kvoffload: use_cuda_graph={use_cuda_graph!r}: the transformers tier does not support transformers' "
            "CUDA graphs; set ContinuousBatchingConfig(use_cuda_graph=False)")


def model_namespace(model_id, dtype, block_size, kv_heads, head_dim, layers):
    """The engine namespace of a model's KV blocks: everything the bytes of
    a block depend on besides its tokens."""
    dt = str(dtype).replace("torch.", "")
    return f"transformers-cb/{model_id}/{dt}/bs{block_size}/kv{kv_heads}x{head_dim}/L{layers}"


def group_namespace(namespace, group):
    """The namespace of layer group group's blocks: keys of two groups over
    the same tokens differ."""
    return f"{namespace}/g{int(group)}"


def default_model_id(model):
    """The model's name or path (with its commit hash when known); for a
    model built from a config (no name), a process-local id, with a
    warning: its blocks are then never shared with another process."""
    cfg = getattr(model, "config", None)
    name = getattr(cfg, "_name_or_path", "") or ""
    if name:
        commit = getattr(cfg, "_commit_hash", None)
        return f"{name}@{commit}" if commit else name
    mid = f"unnamed-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    logger.warning("kvoffload: the model has no name (built from a config?): its blocks get the process-local "
                   "model id %s; pass model_id= to attach() to name its weights", mid)
    return mid


# ---- the tier -------------------------------------------------------------

POOL_CACHES = 4  # default pool: this many times the GPU cache's bytes
MIN_POOL_BYTES = 1 << 30
# A missed lookup is asked again at the latest after this many seconds (a
# store by another process into a shared pool does not land here).
MISS_RECHECK_S = 0.1


def _prompt_ident(prompt_ids, matched, bs):
    """What identifies a waiting request's prompt for the miss memo beyond
    its id and length: the list object and the tokens of the block the
    chain missed at (a request id reused with another prompt differs)."""
    g = matched // bs
    return id(prompt_ids), hash(tuple(prompt_ids[g * bs:(g + 1) * bs]))


def cache_bytes(cache):
    """The bytes of a PagedAttentionCache's KV: blocks x block size x KV
    heads x head dim x 2 (K and V) x layers x dtype size."""
    k = cache.key_cache[0] if cache.key_cache else None
    if hasattr(k, "numel") and hasattr(k, "element_size"):
        return 2 * len(cache.key_cache) * k.numel() * k.element_size()
    dt = getattr(cache, "dtype", None)
    size = getattr(dt, "itemsize", None) or 2
    return (cache.num_blocks * cache.block_size * cache.num_key_value_heads * cache.head_dim * 2
            * len(cache.key_cache) * size)


def default_pool_bytes(gpu_cache_bytes):
    """The pool attach() gives when pool_bytes is None."""
    return max(MIN_POOL_BYTES, POOL_CACHES * int(gpu_cache_bytes))


class _Entry:
    """The kvoffload key of one complete GPU block, valid while the block
    keeps transformers' hash h."""
    __slots__ = ("h", "key", "parent")

    def __init__(self, h, key, parent):
        self.h, self.key, self.parent = h, key, parent


class _Tail:
    """A preempted request's last, partly filled block, stored under key:
    tokens of the block (ntok of them) after the nfull full blocks."""
    __slots__ = ("nfull", "ntok", "key")

    def __init__(self, nfull, ntok, key):
        self.nfull, self.ntok, self.key = nfull, ntok, key


def _wrap(obj, name, fn, installed, clock=None):
    """Installs fn(orig, *args, **kw) as obj.name (an instance attribute
    shadowing the class's method) and records it for removal. clock: a
    Counter that gets, under "ns_<name>", the nanoseconds spent in the
    hook (transformers' own method included) and under "ns_<name>_orig"
    those in the method it wraps: the serving thread's time in the tier is
    the difference."""
    orig = getattr(obj, name)
    if clock is None:
        def hooked(*args, **kw):
            return fn(orig, *args, **kw)
    else:
        now = time.perf_counter_ns
        k_all, k_orig = f"ns_{name}", f"ns_{name}_orig"

        def timed_orig(*args, **kw):
            t = now()
            try:
                return orig(*args, **kw)
            finally:
                clock[k_orig] += now() - t

        def hooked(*args, **kw):
            t = now()
            try:
                return fn(timed_orig, *args, **kw)
            finally:
                clock[k_all] += now() - t

    hooked.__kvo_orig__ = orig
    hooked.__name__ = name
    setattr(obj, name, hooked)
    installed.append((obj, name))
    return hooked


class TransformersOffload:
    """The tier attached to a model or manager (see attach()). Usable as a
    context manager: on exit the hooks on the model are removed and the
    engine is closed.

    pool_bytes: the kvoffload host pool (default: POOL_CACHES times the
    GPU cache's bytes, at least MIN_POOL_BYTES), pinned whole when the
    batch processor is created, before any request runs (nothing is pinned
    while requests are served); engine_config: other engine Config
    fields (policy, staging_bytes, ...); model_id: names the weights in the
    namespace (default: default_model_id); per_layer: True, False or
    "auto" (per-layer load events when the forward runs eagerly, without
    CUDA graphs or compile, through paged|sdpa or paged|eager); observer:
    an object with stored(keys, ids, op, stream) and loaded(keys, ids, op,
    stream), called when a store or load is issued (on the thread that
    issues it, with the compute stream), and optionally finished(kind, op,
    keys, outcomes) once the op is done, before it is released (the
    benchmark checksums blocks there);
    engine_factory(cache, namespace) -> Engine replaces the default
    (Engine.from_tensors over the cache's tensors; tests give a host
    engine); write_behind: store each block once the forward that
    completes it is queued (off the compute stream: nothing waits for it),
    so that evicting or swapping a block already stored copies nothing
    and waits only for a store still in flight on it; False stores at
    eviction and swap only."""

    def __init__(self, pool_bytes=None, engine_config=None, model_id=None, per_layer="auto", observer=None,
                 engine_factory=None, check=True, write_behind=True):
        if pool_bytes is not None and (not isinstance(pool_bytes, int) or isinstance(pool_bytes, bool)
                                       or pool_bytes <= 0):
            raise ValueError(f"kvoffload: pool_bytes={pool_bytes!r}: must be a positive int (bytes), or None to "
                             "size the pool from the GPU cache")
        self.pool_bytes = pool_bytes
        self.write_behind = bool(write_behind)
        self.engine_config = dict(engine_config or {})
        self.model_id = model_id
        self.per_layer_opt = per_layer
        self.observer = observer
        self.engine_factory = engine_factory
        self.check = check
        self.engine = None
        self.namespace = None
        self.key_namespace = None
        self._installed = []  # (object, attribute) of every hook
        self._processor = None
        self._cache = None
        self._stream = None
        self._per_layer = False
        self._keys = {}  # GPU block id -> _Entry
        self._tails = {}  # request id -> _Tail (preempted, not yet resumed)
        self._fix_alloc = set()  # request ids whose allocated_blocks must be set from the block table
        self._key_memo = {}  # request id -> (prompt tokens, chained keys) of waiting requests
        self._stores = deque()  # store ops not yet reaped
        self._inflight = {}  # key -> store op not yet reaped (lookup sees a block once its store is done)
        self._loads = deque()  # load ops not yet reaped
        self._pending_layers = []  # [op, layers waited on, GPU block ids] of per-layer loads not all waited on
        self._landed = {}  # key -> sequence number when its store (or load) showed it in the pool
        self._seq = 0
        self._missed = {}  # request id -> (GPU match, prompt length, first missing key, sequence number,
        #                     _prompt_ident, time of the miss)
        self._lock = threading.RLock()
        self.counters = Counter()
        self.stored_keys = Counter()  # key -> times its outcome was "stored" (a copy into the pool)
        self.closed = False

    # ---- attaching -----------------------------------------------------

    def attach_model(self, model):
        """Hooks model.init_continuous_batching (an instance attribute) so
        that every manager it returns (generate_batch's included) is
        attached."""
        if self.check:
            check_transformers()
        check_model_config(model.config.get_text_config() if hasattr(model.config, "get_text_config")
                           else model.config)
        if self.model_id is None:
            self.model_id = default_model_id(model)
        tier = self

        def init_cb(orig, *args, **kw):
            manager = orig(*args, **kw)
            tier.attach_manager(manager)
            return manager

        _wrap(model, "init_continuous_batching", init_cb, self._installed)
        cached = getattr(model, "_cached_continuous_batching_manager", None)
        if cached is not None:
            self.attach_manager(cached)
        return self

    def attach_manager(self, manager):
        """Checks a ContinuousBatchingManager's configuration and hooks its
        _create_batch_processor (an instance attribute): the batch
        processor, its cache, BlockManager, scheduler and OffloadingManager
        are created there, in the manager's thread."""
        if getattr(manager, "_kvo_tier", None) is self:
            return self
        if getattr(manager, "_kvo_tier", None) is not None:
            raise ValueError("kvoffload: this manager already has a kvoffload tier attached")
        cfg = manager.continuous_batching_config
        space = getattr(cfg, "cpu_offload_space", 0.0)
        if space is None or space > 0:
            raise UnsupportedConfigError(
                f"kvoffload: cpu_offload_space={space!r}: kvoffload replaces transformers' CPU swap pool; set "
                "ContinuousBatchingConfig(cpu_offload_space=0) (the default) so that it is not allocated")
        if not getattr(cfg, "allow_block_sharing", False):
            raise UnsupportedConfigError("kvoffload: allow_block_sharing=False: the tier extends transformers' "
                                         "prefix sharing, which must be on")
        check_no_cuda_graphs(getattr(cfg, "use_cuda_graph", None))
        model = getattr(manager, "model", None)
        if model is not None:
            check_model_config(model.config.get_text_config() if hasattr(model.config, "get_text_config")
                               else model.config)
            if self.model_id is None:
                self.model_id = default_model_id(model)
        tier = self

        def create(orig, *args, **kw):
            bp = orig(*args, **kw)
            tier.attach_processor(bp)
            return bp

        _wrap(manager, "_create_batch_processor", create, self._installed)
        manager._kvo_tier = self
        self._installed.append((manager, "_kvo_tier"))
        if getattr(manager, "batch_processor", None) is not None:
            self.attach_processor(manager.batch_processor)
        return self

    def attach_processor(self, bp):
        """Installs the hooks on a ContinuousBatchProcessor's objects and
        creates the engine over its cache. Idempotent for a processor that
        is reused (reset) by the manager."""
        with self._lock:
            if bp is self._processor:
                self._tails.clear()
                self._fix_alloc.clear()
                self._key_memo.clear()
                self._missed.clear()
                return
            cache = bp.cache
            if getattr(cache, "num_groups", 1) != 1 or getattr(cache, "num_sliding_attention_groups", 0):
                raise UnsupportedModelError(f"kvoffload: the cache has {cache.num_groups} layer groups; the tier "
                                            "supports one full-attention group (see the module doc)")
            if getattr(getattr(bp, "distributed_helper", None), "tp_size", 1) > 1:
                raise UnsupportedModelError("kvoffload: tensor parallelism is not supported by the transformers tier")
            check_no_cuda_graphs((getattr(bp, "use_cuda_graph_varlen", False), getattr(bp, "use_cuda_graph_decode",
                                                                                       False)))
            if not cache.use_prefix_sharing:
                raise UnsupportedConfigError("kvoffload: the cache does not use prefix sharing (allow_block_sharing "
                                             "off, or several layer groups)")
            self._drain(close_engine=True)
            self._processor, self._cache = bp, cache
            self._stream = getattr(bp.inputs_and_outputs, "compute_stream", None)
            self._keys.clear()
            self._tails.clear()
            self._fix_alloc.clear()
            self._key_memo.clear()
            self._missed.clear()
            self._landed.clear()
            if self.model_id is None:
                self.model_id = f"unnamed-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            self.namespace = model_namespace(self.model_id, cache.dtype, cache.block_size, cache.num_key_value_heads,
                                             cache.head_dim, len(cache.key_cache))
            self.key_namespace = group_namespace(self.namespace, 0)
            self.engine = self._make_engine(cache)
            self._per_layer = self._decide_per_layer(bp)
            bm = cache._block_manager
            c = self.counters
            _wrap(bm, "has_enough_free_blocks", self._has_enough_free_blocks, self._installed, c)
            _wrap(bm, "mark_shareable_blocks_as_complete", self._mark_complete, self._installed, c)
            _wrap(cache, "search_prefix_match", self._search_prefix_match, self._installed, c)
            if self._per_layer:
                _wrap(cache, "update", self._update, self._installed, c)
            _wrap(bp.scheduler, "_infer_request_tokens", self._infer_request_tokens, self._installed, c)
            _wrap(bp.offloading_manager, "_offload_to_cpu", self._offload_to_cpu, self._installed, c)
            self.counters["processors"] += 1

    def _make_engine(self, cache):
        if self.engine_factory is not None:
            return self.engine_factory(cache, self.namespace)
        from ..engine import Engine
        shape = (-1, cache.block_size, cache.num_key_value_heads, cache.head_dim)
        kv = [(k.view(*shape), v.view(*shape)) for k, v in zip(cache.key_cache, cache.value_cache)]
        cfg = dict(self.engine_config)
        cfg.setdefault("namespace", self.namespace)
        pool = self.pool_bytes or default_pool_bytes(cache_bytes(cache))
        # The whole pool is pinned here, while the batch processor is
        # created and before any request runs: pinning later, in the
        # background, would run beside the forwards it could stall.
        cfg.setdefault("first_region_bytes", pool)
        eng = Engine.from_tensors(kv, pool, **cfg)
        # Growth, then the calibration of the copy methods (copies of their
        # own on the GPU), end before the first request: run beside the
        # first forwards they would slow them.
        try:
            eng.wait_grown()
        except KvoError as e:  # the engine works with what it pinned
            logger.warning("kvoffload: pool growth stopped: %s", e)
        return eng

    def _decide_per_layer(self, bp):
        if self.per_layer_opt in (True, False):
            return self.per_layer_opt
        if self._stream is None:
            return False
        attn = getattr(getattr(bp, "config", None), "_attn_implementation", "") or ""
        if attn not in ("paged|sdpa", "paged|eager"):
            return False  # flash's decode fast path reads the cache without cache.update
        cfg = getattr(bp, "cb_config", None)
        graphs = getattr(cfg, "use_cuda_graph", None)
        if graphs is None and hasattr(bp, "use_cuda_graph_varlen"):  # transformers' automatic choice, resolved
            graphs = (bp.use_cuda_graph_varlen, getattr(bp, "use_cuda_graph_decode", False))
        if graphs is None or (isinstance(graphs, tuple) and any(graphs)) or graphs is True:
            return False
        if getattr(cfg, "varlen_compile_config", None) is not None or getattr(cfg, "decode_compile_config", None):
            return False
        return True

    # ---- ordering helpers ------------------------------------------------

    def _wait_op(self, op):
        """The compute stream waits on op's copies (the CPU, without streams)."""
        if self._stream is not None:
            op.wait_stream(self._stream)
        else:
            op.wait()

    def _flush_loads(self, ids=None):
        """Makes the compute stream wait on the per-layer loads whose layers
        the forward may not have waited on yet: those writing any of the
        GPU blocks ids (before those blocks are stored or handed to another
        request), or all of them (ids None: once a batch is over)."""
        keep = []
        for entry in self._pending_layers:
            if ids is None or not entry[2].isdisjoint(ids):
                self._wait_op(entry[0])
            else:
                keep.append(entry)
        self._pending_layers[:] = keep

    def _unpend(self, op):
        """A per-layer load about to be released: the compute stream waits on
        the whole of it (it is done, or about to be) instead of on its
        layers."""
        for i, entry in enumerate(self._pending_layers):
            if entry[0] is op:
                del self._pending_layers[i]
                if self._stream is not None:
                    op.wait_stream(self._stream)
                return

    def _land(self, key):
        self._seq += 1
        self._landed[key] = self._seq

    def _reap(self, wait=False):
        """Collects the outcomes of the ops that are done (all of them with
        wait=True) and releases them."""
        for ops, kind in ((self._stores, "store"), (self._loads, "load")):
            for _ in range(len(ops)):
                op, keys = ops.popleft()
                if not wait and not op.done():
                    ops.append((op, keys))
                    continue
                if kind == "load":
                    self._unpend(op)
                try:
                    outs = op.wait()
                except KvoError as e:  # a failed copy: its outcomes say which
                    self.counters[f"{kind}_errors"] += 1
                    logger.error("kvoffload: %s op failed: %s", kind, e)
                    outs = op.outcomes()
                for key, o in zip(keys, outs):
                    self.counters[f"{kind}_{o}"] += 1
                    if o == "stored":
                        self.stored_keys[key] += 1
                    if kind == "store":
                        if o in ("stored", "already-present"):
                            self._land(key)
                        else:
                            self._landed.pop(key, None)
                if kind == "store":
                    for key in keys:
                        if self._inflight.get(key) is op:
                            del self._inflight[key]
                done = getattr(self.observer, "finished", None)
                if done is not None:
                    done(kind, op, keys, outs)
                op.release()

    def _store(self, keys, ids, parents=None, parent=None, why="evict", wait=True):
        """Stores GPU blocks ids under keys, after the compute stream's
        queued work; with wait, the compute stream's later work (the
        blocks' overwrite) waits for the copies. Per-layer loads still
        writing those blocks are waited on first."""
        if not keys:
            return None
        self._flush_loads(ids)
        try:
            op = self.engine.store(keys, ids, after=self._stream, parents=parents, parent=parent)
        except KvoError as e:  # nothing was stored: those blocks are computed again if needed
            self.counters["store_refused"] += 1
            logger.warning("kvoffload: store of %d blocks refused: %s", len(keys), e)
            return None
        if self.observer is not None:
            self.observer.stored(list(keys), list(ids), op, self._stream)
        if wait:  # the blocks' overwrite, queued later, waits for the copies
            self._wait_op(op)
        self._stores.append((op, list(keys)))
        for k in keys:
            self._inflight[k] = op
        self.counters[f"{why}_store_blocks"] += len(keys)
        self.counters[f"{why}_stores"] += 1
        return op

    def _present(self, keys):
        """The keys the pool holds now: lookup answers how many leading keys
        it holds, so a run of present keys costs one call, and each absent
        key one more."""
        out, i = set(), 0
        while i < len(keys):
            n = self.engine.lookup(keys[i:])
            out.update(keys[i:i + n])
            i += n + 1
        return out

    def _store_or_wait(self, keys, ids, parents, why):
        """Before GPU blocks ids (holding keys) are handed to another
        request: blocks already in the pool cost nothing, blocks whose
        store is in flight make the compute stream wait on that store
        alone, the others are stored now (and waited on)."""
        skeys, sids, sparents, waits = [], [], [], {}
        self._flush_loads(ids)
        # _landed is a hint: the pool may have dropped a key since (its own
        # eviction, a delete, a trim). Those it still holds are confirmed
        # here, one lookup for a run of present keys.
        landed = [k for k in keys if k in self._landed]
        present = self._present(landed) if landed else set()
        for k, b, p in zip(keys, ids, parents):
            if k in present:
                self.counters[f"{why}_already_stored"] += 1
                continue
            if k in self._landed:
                del self._landed[k]
                self.counters[f"{why}_dropped_from_pool"] += 1
            op = self._inflight.get(k)
            if op is not None:
                waits[id(op)] = op
                self.counters[f"{why}_waited_inflight"] += 1
                continue
            skeys.append(k)
            sids.append(b)
            sparents.append(p)
        for op in waits.values():
            self._wait_op(op)
        self._store(skeys, sids, parents=sparents, why=why)

    # ---- hook: store before eviction ----------------------------------------

    def _has_enough_free_blocks(self, orig, n_blocks):
        with self._lock:
            bm = self._cache._block_manager
            short = n_blocks - len(bm._uninit_block_ids)
            if short > 0 and len(bm._init_block_ids) >= short:
                # orig pops _init_block_ids.popitem() short times: the last-inserted ones.
                victims = list(itertools.islice(reversed(bm._init_block_ids), short))
                keys, ids, parents, seen = [], [], [], set()
                for bid in victims:
                    e = self._keys.pop(bid, None)
                    blk = bm._id_to_block.get(bid)
                    if e is None or blk is None or blk.hash != e.h or e.key in seen:
                        self.counters["evict_unknown"] += 1
                        continue
                    seen.add(e.key)
                    keys.append(e.key)
                    ids.append(bid)
                    parents.append(e.parent)
                self.counters["evicted_blocks"] += len(victims)
                self._store_or_wait(keys, ids, parents, "evict")
            return orig(n_blocks)

    def _mark_complete(self, orig, num_complete_blocks, allocated_blocks, prompt_ids):
        with self._lock:
            r = orig(num_complete_blocks, allocated_blocks, prompt_ids)
            fresh = self._learn(allocated_blocks, prompt_ids)
            if fresh and self.write_behind:
                # Write-behind: the forward that wrote these blocks is queued
                # on the compute stream; the store's copies wait for it on
                # the copy stream, and the compute stream does not wait.
                self._store([e.key for _, e in fresh], [b for b, _ in fresh], parents=[e.parent for _, e in fresh],
                            why="behind", wait=False)
            return r

    def _learn(self, table, tokens):
        """Records the key of every complete block of a block table (a
        request's blocks in order, tokens its token ids). Returns the
        [(block id, _Entry)] of the complete blocks neither in the pool nor
        being stored."""
        bm = self._cache._block_manager
        bs = self._cache.block_size
        parent = None
        fresh = []
        for i, bid in enumerate(table):
            blk = bm._id_to_block.get(bid)
            if blk is None or blk.hash is None:
                break
            e = self._keys.get(bid)
            if e is None or e.h != blk.hash:
                chunk = tokens[i * bs:(i + 1) * bs]
                if len(chunk) < bs:
                    break
                e = _Entry(blk.hash, block_key(chunk, self.key_namespace, parent), parent)
                self._keys[bid] = e
            if e.key not in self._landed and e.key not in self._inflight:
                fresh.append((bid, e))
            parent = e.key
        return fresh

    # ---- hook: prefix lookup past the GPU -----------------------------------

    def _search_prefix_match(self, orig, request_id, prompt_ids):
        with self._lock:
            self._reap()
            self._tails_started()
            matched = orig(request_id, prompt_ids)
            miss = self._missed.get(request_id)
            if miss is not None:
                m, n, key, seq, ident, at = miss
                if (m == matched and n == len(prompt_ids) and self._landed.get(key, 0) <= seq
                        and ident == _prompt_ident(prompt_ids, matched, self._cache.block_size)
                        and time.monotonic() - at < MISS_RECHECK_S):
                    # The chain missed here before, and no store of the key
                    # it missed has landed since: nothing to look up.
                    self.counters["lookups"] += 1
                    self.counters["lookups_skipped"] += 1
                    self.counters["gpu_prefix_blocks"] += matched // self._cache.block_size
                    return matched
                del self._missed[request_id]
            try:
                extra = self._extend(request_id, prompt_ids, matched)
            except KvoError as e:  # the GPU prefix stands; the rest is computed
                logger.error("kvoffload: prefix lookup for %s failed: %s", request_id, e)
                self.counters["lookup_errors"] += 1
                extra = 0
            self.counters["lookups"] += 1
            self.counters["gpu_prefix_blocks"] += matched // self._cache.block_size
            if matched + extra:  # the request leaves the waiting queue
                self._key_memo.pop(request_id, None)
            return matched + extra

    def _prompt_keys(self, request_id, prompt_ids, n):
        """The chained keys of the first n blocks of a prompt. A waiting
        request is looked up at every batch until it is scheduled: its keys
        are kept by request id, with its tokens, and reused when the tokens
        are equal (a list comparison, not the hashing again)."""
        bs = self._cache.block_size
        got = self._key_memo.get(request_id)
        if got is not None and len(got[1]) >= n and got[0] == prompt_ids:
            return got[1][:n]
        keys = chain_keys(prompt_ids[:n * bs], bs, namespace=self.key_namespace)
        if len(self._key_memo) >= 1024:
            self._key_memo.clear()
        self._key_memo[request_id] = (list(prompt_ids), keys)
        return keys

    def _tails_started(self):
        """Preempted requests that transformers started again without this
        tier's lookup finding their blocks (deferred for room, then
        scheduled by transformers with less): counted as partly resumed."""
        if not self._tails:
            return
        active = getattr(getattr(self._processor, "scheduler", None), "active_requests", {})
        for rid in [r for r in self._tails if r in active]:
            del self._tails[rid]
            self.counters["resumed_partly"] += 1

    def _extend(self, request_id, prompt_ids, matched):
        """Continues transformers' prefix match (matched tokens, its blocks in
        the request's block table): blocks on the GPU again after a gap are
        referenced, blocks in kvoffload loaded, in any order, up to the
        first block found in neither or the last full block before the
        prompt's last token; then a preempted request's partial last block.
        Returns the tokens added to matched."""
        cache = self._cache
        bm = cache._block_manager
        cm = cache.group_cache_managers[0]
        bs = cache.block_size
        tail = self._tails.pop(request_id, None)
        g = matched // bs
        limit = (len(prompt_ids) - 1) // bs  # full blocks before the last token (which is always computed)
        table = cm.block_table.get(request_id)
        if table is None:
            table = []
        if len(table) != g:  # not the state search_prefix_match leaves: leave it alone
            self.counters["lookup_skipped"] += 1
            return 0
        keys = self._prompt_keys(request_id, prompt_ids, max(limit, g))
        h = bm._id_to_block[table[-1]].hash if table else None
        pos, deferred = g, False
        while pos < limit:
            nh = bm.compute_hash(h, prompt_ids[pos * bs:(pos + 1) * bs], 0)
            bid = bm._hash_to_id.get(nh)
            if bid is not None:  # on the GPU after a gap: shared, as transformers' own match does
                bm.increase_ref_count(bid)
                table.append(bid)
                h, pos = nh, pos + 1
                self.counters["gpu_after_gap_blocks"] += 1
                continue
            # In kvoffload? One lookup over the rest of the chain; only the
            # blocks it finds are hashed the way transformers hashes them.
            try:
                n = self.engine.lookup(keys[pos:limit])
            except KvoError as e:  # what is appended so far stands; the rest is computed
                logger.error("kvoffload: lookup for %s failed: %s", request_id, e)
                self.counters["lookup_errors"] += 1
                break
            if n == 0 and keys[pos] not in self._inflight:
                if pos == g and tail is None:
                    if len(self._missed) >= 4096:
                        self._missed.clear()
                    self._missed[request_id] = (matched, len(prompt_ids), keys[pos], self._seq,
                                                _prompt_ident(prompt_ids, matched, bs), time.monotonic())
                    self.counters["lookup_misses"] += 1
                break
            hashes, hh = [nh], nh
            for b in range(pos + 1, pos + max(n, 1)):
                hh = bm.compute_hash(hh, prompt_ids[b * bs:(b + 1) * bs], 0)
                if hh in bm._hash_to_id:
                    break
                hashes.append(hh)
            try:
                got, deferred = self._load_full(table, keys[pos:pos + len(hashes)], hashes,
                                                keys[pos - 1] if pos else None)
            except KvoError as e:  # _load_full appends only loads it issued: those stand
                logger.error("kvoffload: load for %s failed: %s", request_id, e)
                self.counters["lookup_errors"] += 1
                break
            if not got:
                break
            h, pos = hashes[got - 1], pos + got
            if got < len(hashes):
                break
        if pos > g:
            cm.block_table[request_id] = table
        extra = (pos - g) * bs
        if deferred and not table:  # still waiting for room: the next scheduling looks again
            if tail is not None:
                self._tails[request_id] = tail
            return 0
        if tail is not None and pos == tail.nfull and tail.ntok:
            extra += self._load_tail(request_id, table, tail, prompt_ids, keys[tail.nfull - 1] if tail.nfull else None)
            cm.block_table[request_id] = table
        if tail is not None:  # a preempted request back: did all its KV come back?
            lost = len(prompt_ids) - 1 - matched - extra
            if lost <= 0:
                self.counters["resumed"] += 1
            else:
                self.counters["resumed_partly"] += 1
                self.counters["resume_recomputed_tokens"] += lost
        return extra

    def _lease(self, keys, n):
        """(hits, lease) over keys[:n] (n > 0). A key whose store is still in
        flight (evicted moments ago, in this scheduling pass) is not in the
        pool yet: the lookup waits for that store (one device-to-host copy
        of a few blocks) rather than recompute the block."""
        hits, lease = self.engine.lookup(keys[:n], lease=True)
        if hits < n and keys[hits] in self._inflight:
            if lease is not None:
                lease.release()
            self._inflight[keys[hits]].wait()
            self.counters["lookup_waited_store"] += 1
            self._reap()
            hits, lease = self.engine.lookup(keys[:n], lease=True)
        return hits, lease

    def _load_full(self, table, keys, hashes, parent_key):
        """Loads the leading keys found in kvoffload into new GPU blocks
        appended to table (given transformers' hashes). Returns (blocks
        loaded, deferred: the request holds nothing on the GPU and there is
        no room yet)."""
        bm = self._cache._block_manager
        hits, lease = self._lease(keys, len(keys))
        if not hits:
            return 0, False
        room = bm.num_free_blocks
        if not table:
            # Nothing on the GPU: the request is still waiting. Load what fits
            # with a block to spare for the tokens after it (transformers
            # allocates its next chunk from there); with no room at all it
            # keeps waiting and looks again at the next batch.
            if room < 2:
                lease.release()
                self.counters["lookup_deferred"] += 1
                return 0, True
            room -= 1
        if hits > room:
            lease.release()
            if room == 0:
                self.counters["lookup_no_room"] += 1
                return 0, False
            hits, lease = self._lease(keys, room)
            if not hits:
                return 0, False
        ids = bm.get_free_blocks(hits, table[-1] if table else None, True, 0)
        if ids is None:
            lease.release()
            self.counters["lookup_no_room"] += 1
            return 0, False
        if not self._issue_load(keys[:hits], ids, lease):
            for bid in ids:  # still incomplete: back to the free blocks
                bm.uninitialize_unshared_block(bid)
            return 0, False
        parent = parent_key
        for bid, h, key in zip(ids, hashes, keys):
            blk = bm._id_to_block[bid]
            blk.hash = h
            bm._hash_to_id[h] = bid
            self._keys[bid] = _Entry(h, key, parent)
            parent = key
        table.extend(ids)
        self.counters["kvo_prefix_blocks"] += hits
        self.counters["kvo_prefix_loads"] += 1
        return hits, False

    def _load_tail(self, request_id, table, tail, prompt_ids, parent_key):
        bs = self._cache.block_size
        start = tail.nfull * bs
        toks = prompt_ids[start:start + tail.ntok]
        if len(toks) != tail.ntok or block_key(toks, self.key_namespace, parent_key) != tail.key:
            self.counters["tail_mismatch"] += 1
            return 0
        usable = min(tail.ntok, len(prompt_ids) - 1 - start)
        if usable <= 0:
            return 0
        bm = self._cache._block_manager
        if bm.num_free_blocks < 1:
            self.counters["tail_no_room"] += 1
            return 0
        hits, lease = self._lease([tail.key], 1)
        if not hits:
            self.counters["tail_missing"] += 1
            return 0
        ids = bm.get_free_blocks(1, table[-1] if table else None, True, 0)
        if ids is None:
            lease.release()
            self.counters["tail_no_room"] += 1
            return 0
        if not self._issue_load([tail.key], ids, lease):
            bm.uninitialize_unshared_block(ids[0])
            return 0
        table.extend(ids)  # an incomplete block: transformers hashes it once it is full
        self._fix_alloc.add(request_id)
        self.counters["tail_blocks"] += 1
        return usable

    def _issue_load(self, keys, ids, lease):
        """Loads keys (leased) into GPU blocks ids, ordered after the compute
        stream's queued work and before its next reads. False when the
        engine refused the load (the lease is released, nothing was
        copied)."""
        try:
            op = self.engine.load(keys, ids, lease=lease, after=self._stream, per_layer=self._per_layer)
        except KvoError as e:  # e.g. BusyError: the copy queue is full; the blocks are computed instead
            self.counters["load_refused"] += 1
            logger.warning("kvoffload: load of %d blocks refused: %s", len(keys), e)
            try:
                lease.release()
            except KvoError:
                pass
            return False
        if self._per_layer:
            self._pending_layers.append([op, set(), set(ids)])
        elif self._stream is not None:
            op.wait_stream(self._stream)
        else:
            op.wait()
        if self.observer is not None:
            self.observer.loaded(list(keys), list(ids), op, self._stream)
        self._loads.append((op, list(keys)))
        for k in keys:  # leased into the load: in the pool, nothing to store when its GPU block goes
            self._land(k)
        return True

    def _update(self, orig, key_states, value_states, layer_idx, read_index, write_index):
        """cache.update with per-layer loads: the current stream (the compute
        stream) waits on layer layer_idx's copies before reading the cache."""
        if self._pending_layers:
            with self._lock:  # stats() on another thread may reap (and unpend) meanwhile
                self._wait_layers(layer_idx)
        return orig(key_states, value_states, layer_idx, read_index, write_index)

    def _wait_layers(self, layer_idx):
        pending = self._pending_layers
        stream = self._current_stream()
        _, j = self._cache.layer_index_to_group_indices[layer_idx]
        nlayers = len(self._cache.key_cache)
        for entry in list(pending):
            op, seen = entry[0], entry[1]
            if j not in seen:
                if stream is None:  # no streams (host backend): the CPU waits
                    op.wait()
                else:
                    op.wait_layer(j, stream)
                seen.add(j)
            if len(seen) == nlayers:
                pending.remove(entry)

    @staticmethod
    def _current_stream():
        import torch
        return torch.cuda.current_stream()

    def _infer_request_tokens(self, orig, state, request_ids_to_remove_from_waiting):
        tokens = orig(state, request_ids_to_remove_from_waiting)
        rid = state.request_id
        if rid in self._fix_alloc:
            # search_prefix_match returned a length that ends inside the
            # loaded partial block: count that block as allocated.
            self._fix_alloc.discard(rid)
            state.allocated_blocks = max(len(cm.block_table.get(rid, ())) for cm in self._cache.group_cache_managers)
        return tokens

    # ---- hook: swap on preemption ---------------------------------------------

    def _offload_to_cpu(self, orig, victims):
        with self._lock:
            self._reap()
            cache = self._cache
            bs = cache.block_size
            cm = cache.group_cache_managers[0]
            all_keys, all_ids, all_parents, seen = [], [], [], set()
            for state in victims:
                rid = state.request_id
                seq = list(state.initial_tokens) + list(state.generated_tokens)
                have = state.position_offset  # tokens whose KV is in the request's blocks
                table = cm.block_table.get(rid, [])
                nfull, ntok = divmod(min(have, len(seq)), bs)
                if nfull + (1 if ntok else 0) > len(table):
                    self.counters["swap_skipped"] += 1
                    continue
                keys = chain_keys(seq[:nfull * bs], bs, namespace=self.key_namespace)
                ids = list(table[:nfull])
                tkey = None
                if ntok:
                    tkey = block_key(seq[nfull * bs:nfull * bs + ntok], self.key_namespace, keys[-1] if keys else None)
                    keys.append(tkey)
                    ids.append(table[nfull])
                if rid in self._tails:  # started again without its blocks, and preempted again
                    self.counters["resumed_partly"] += 1
                self._tails[rid] = _Tail(nfull, ntok, tkey)
                self._missed.pop(rid, None)
                for i, (k, b) in enumerate(zip(keys, ids)):
                    if k not in seen:  # a prefix shared by two victims: once
                        seen.add(k)
                        all_keys.append(k)
                        all_ids.append(b)
                        all_parents.append(keys[i - 1] if i else None)
                self.counters["swapped_requests"] += 1
            # Blocks already in the pool (stored behind the forward, or
            # loaded) cost nothing; the rest are stored now and the compute
            # stream waits before the freed blocks are written again.
            self._store_or_wait(all_keys, all_ids, all_parents, "swap")
            # No victim is "CPU-offloaded" for transformers: it requeues each
            # as prompt + generated tokens (its soft reset), and the prefix
            # lookup brings the blocks back from the GPU or kvoffload.
            return set()

    # ---- reporting and closing -----------------------------------------------

    def stats(self, wait=True):
        """The tier's counters (dict), after collecting the outcomes of the
        ops done (all of them, waiting, with wait=True). Keys:
        lookups, gpu_prefix_blocks (transformers' own matches),
        kvo_prefix_blocks / kvo_prefix_requests (loaded from kvoffload by
        the prefix lookup), evicted_blocks / evict_store_blocks /
        evict_unknown, swapped_requests / swap_store_blocks, tail_blocks,
        resumed (preempted requests whose every block came back: only their
        last token is computed again), resumed_partly and
        resume_recomputed_tokens (the others, and the tokens they recompute),
        store_<outcome> / load_<outcome> per block, keys_stored_twice (keys
        copied into the pool more than once), behind_store_blocks (stored
        behind the forward), evict_already_stored / swap_already_stored
        (nothing to copy), evict_waited_inflight / swap_waited_inflight
        (waited on a store in flight), lookup_misses and lookups_skipped
        (misses not asked again), ns_<hook> and ns_<hook>_orig (nanoseconds
        on the serving thread in each hook, and in transformers' method it
        wraps), and the engine's stats under "engine"."""
        with self._lock:
            if self.engine is not None and not self.engine.closed:
                self._reap(wait=wait)
            self._tails_started()
            out = dict(self.counters)
            out["keys_stored"] = len(self.stored_keys)
            out["keys_stored_twice"] = sum(1 for c in self.stored_keys.values() if c > 1)
            out["per_layer"] = self._per_layer
            out["namespace"] = self.namespace
            if self.engine is not None and not self.engine.closed:
                out["engine"] = self.engine.stats()
            return out

    def _drain(self, close_engine):
        self._flush_loads()
        if self.engine is not None and not self.engine.closed:
            self._reap(wait=True)
            if close_engine:
                self.engine.close()
        if close_engine:
            self._remove_hooks(keep_roots=True)

    def _remove_hooks(self, keep_roots):
        """Removes the hooks (keep_roots: those on the model and manager
        stay, so a new batch processor is attached again)."""
        kept = []
        for obj, name in reversed(self._installed):
            root = name in ("init_continuous_batching", "_create_batch_processor", "_kvo_tier")
            if keep_roots and root:
                kept.append((obj, name))
                continue
            try:
                delattr(obj, name)
            except AttributeError:
                pass
        self._installed = list(reversed(kept))

    def close(self):
        """Waits for the copies in flight, closes the engine and removes every
        hook. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self._drain(close_engine=True)
            self._remove_hooks(keep_roots=False)
            self._processor = self._cache = None
            self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def attach(target, pool_bytes=None, **kw):
    """Attaches a kvoffload tier to a transformers model (every continuous
    batching manager it creates: generate_batch,
    continuous_batching_context_manager, init_continuous_batching) or to one
    ContinuousBatchingManager. Returns the TransformersOffload (a context
    manager; see its doc for the keyword arguments). Raises
    UnsupportedVersionError, UnsupportedModelError or UnsupportedConfigError
    (see the module doc) before anything is changed."""
    tier = TransformersOffload(pool_bytes=pool_bytes, **kw)
    if hasattr(target, "_create_batch_processor") and hasattr(target, "continuous_batching_config"):
        if tier.check:
            check_transformers()
        return tier.attach_manager(target)
    if hasattr(target, "init_continuous_batching"):
        return tier.attach_model(target)
    raise TypeError(f"kvoffload: attach takes a transformers model with continuous batching or a "
                    f"ContinuousBatchingManager, got {type(target).__name__}")


__all__ = [
    "attach", "TransformersOffload", "SUPPORTED_VERSIONS", "HOOKED_SIGNATURES", "check_version", "check_signatures",
    "check_transformers", "check_model_config", "layer_groups", "model_namespace", "group_namespace",
    "default_model_id", "TransformersIntegrationError", "UnsupportedVersionError", "UnsupportedModelError",
    "UnsupportedConfigError", "ZERO_KEY",
]
