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

import logging
import os
import threading
import time
import uuid
from collections import Counter, deque

from ..errors import KvoError
from ..keys import ZERO_KEY
# The checks live in _tf_checks, the stores and the loads in the mixins
# _tf_store and _tf_load; the public names are this module's.
from ._tf_checks import (HOOKED_SIGNATURES, SUPPORTED_VERSIONS, UNTESTED_ENV, TransformersIntegrationError,
                         UnsupportedConfigError, UnsupportedModelError, UnsupportedVersionError, check_model_config,
                         check_no_cuda_graphs, check_signatures, check_transformers, check_version, default_model_id,
                         group_namespace, layer_groups, model_namespace, parse_version, transformers_classes)
from ._tf_common import _prompt_ident
from ._tf_load import _Loads
from ._tf_store import _Stores

logger = logging.getLogger("kvoffload.transformers")

POOL_CACHES = 4  # default pool: this many times the GPU cache's bytes
MIN_POOL_BYTES = 1 << 30
# A missed lookup is asked again at the latest after this many seconds (a
# store by another process into a shared pool does not land here).
MISS_RECHECK_S = 0.1


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


class TransformersOffload(_Stores, _Loads):
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
    "UnsupportedConfigError", "ZERO_KEY", "UNTESTED_ENV", "parse_version", "transformers_classes",
    "check_no_cuda_graphs",
]
