"""transformers' own continuous-batching scheduling code, run on the CPU
without torch, for the kvoffload tier's tests: requests.py, cache_manager.py,
scheduler.py and offloading_manager.py are loaded from a transformers
source tree (the installed transformers', $KVO_TRANSFORMERS_SRC, or
/work/ref/transformers-5.17) under a private package name, with stand-ins
only for what they import for annotations (torch, transformers.utils,
.cache, .distributed); PagedAttentionCache's bookkeeping methods are
compiled from cache.py's source onto a class holding the attributes its
__init__ sets, without tensors. The batch loop (Loop) follows
ContinuousBatchProcessor.prepare_next_batch / update_batch (sync mode),
with the fake model's KV in a host engine's simulated GPU (tf_fakes.FakeGPU):
every KV read is checked against what computing it writes."""

import ast
import hashlib
import importlib.util
import logging
import os
import struct
import sys
import types

PKG = "kvo_tfsrc"
REF = "/work/ref/transformers-5.17"
CACHE_METHODS = ("blocks_needed", "will_allocation_be_successful", "blocks_in_use", "allocate_blocks", "free_blocks",
                 "get_num_free_blocks", "search_prefix_match", "mark_shareable_blocks_as_complete",
                 "free_all_requests")


def source_dir():
    """The transformers package folder to load from, or None."""
    env = os.environ.get("KVO_TRANSFORMERS_SRC")
    cands = [env] if env else []
    spec = importlib.util.find_spec("transformers")
    if spec is not None and spec.origin:
        cands.append(os.path.dirname(spec.origin))
    cands.append(REF)
    for c in cands:
        if c and os.path.exists(os.path.join(c, "generation", "continuous_batching", "scheduler.py")):
            return c
    return None


def _stub_torch():
    t = types.ModuleType("torch")

    class _Any:
        def __init__(self, *a, **k):
            pass

    t.Tensor = t.device = t.dtype = _Any
    t.cuda = types.SimpleNamespace(Stream=_Any, Event=_Any, is_available=lambda: False)
    t.float16 = t.bfloat16 = t.float32 = _Any()
    return t


_loaded = {}


def load(src=None):
    """A namespace of transformers' classes loaded from src (see module doc)."""
    src = src or source_dir()
    if src in _loaded:
        return _loaded[src]
    cb_dir = os.path.join(src, "generation", "continuous_batching")
    saved = {k: sys.modules.get(k) for k in ("torch",)}
    try:
        __import__("torch")  # the real one when there is one
    except ImportError:
        sys.modules["torch"] = _stub_torch()
    try:
        def pkg(name, path=None):
            m = types.ModuleType(name)
            m.__path__ = [path] if path else []
            sys.modules[name] = m
            return m

        for k in [k for k in sys.modules if k == PKG or k.startswith(PKG + ".")]:
            del sys.modules[k]
        pkg(PKG)
        utils = pkg(f"{PKG}.utils")
        utils.is_psutil_available = lambda: False
        utils.is_torch_xpu_available = lambda: False
        lg = types.ModuleType(f"{PKG}.utils.logging")
        lg.logging = logging
        sys.modules[lg.__name__] = lg
        pkg(f"{PKG}.generation", os.path.join(src, "generation"))
        cb = pkg(f"{PKG}.generation.continuous_batching", cb_dir)
        cache_stub = types.ModuleType(f"{PKG}.generation.continuous_batching.cache")
        cache_stub.PagedAttentionCache = object
        sys.modules[cache_stub.__name__] = cache_stub
        dist = types.ModuleType(f"{PKG}.generation.continuous_batching.distributed")
        dist.DistributedHelper = object
        sys.modules[dist.__name__] = dist

        def mod(name):
            full = f"{PKG}.generation.continuous_batching.{name}"
            spec = importlib.util.spec_from_file_location(full, os.path.join(cb_dir, name + ".py"))
            m = importlib.util.module_from_spec(spec)
            sys.modules[full] = m
            spec.loader.exec_module(m)
            setattr(cb, name, m)
            return m

        requests = mod("requests")
        cache_manager = mod("cache_manager")
        scheduler = mod("scheduler")
        offloading = mod("offloading_manager")
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    ns = types.SimpleNamespace(src=src, requests=requests, cache_manager=cache_manager, scheduler=scheduler,
                               offloading=offloading, RequestState=requests.RequestState,
                               RequestStatus=requests.RequestStatus, TMP_TOKEN_ID=requests.TMP_TOKEN_ID,
                               BlockManager=cache_manager.BlockManager,
                               FullAttentionCacheAllocator=cache_manager.FullAttentionCacheAllocator,
                               FIFOScheduler=scheduler.FIFOScheduler, OffloadingManager=offloading.OffloadingManager)
    ns.PagedAttentionCache = _cache_class(ns, os.path.join(cb_dir, "cache.py"))
    _loaded[src] = ns
    return ns


def _cache_class(ns, path):
    """A PagedAttentionCache whose bookkeeping methods are cache.py's own."""
    with open(path) as f:
        tree = ast.parse(f.read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PagedAttentionCache")
    funcs = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in CACHE_METHODS]
    missing = set(CACHE_METHODS) - {f.name for f in funcs}
    if missing:
        raise RuntimeError(f"{path}: PagedAttentionCache has no {sorted(missing)}")
    for f in funcs:
        f.returns = None  # annotations name torch types
        for a in f.args.args:
            a.annotation = None
    module = ast.Module(body=funcs, type_ignores=[])
    glb = {"logger": ns.requests.logger, "RequestStatus": ns.RequestStatus, "RequestState": ns.RequestState}
    exec(compile(module, path, "exec"), glb)

    class PagedAttentionCache:
        def __init__(self, num_blocks, block_size, layers, kv_heads=2, head_dim=8, max_batch_tokens=512):
            self.block_size = block_size
            self.num_blocks = num_blocks
            self.num_pages = num_blocks * block_size
            self.max_batch_tokens = max_batch_tokens
            self.dtype = "bfloat16"
            self.num_key_value_heads = kv_heads
            self.head_dim = head_dim
            self.key_cache = [None] * layers
            self.value_cache = [None] * layers
            self.config = types.SimpleNamespace(sliding_window=None)
            self.num_groups = 1
            self.layer_index_to_group_indices = {l: (0, l) for l in range(layers)}
            self.sliding_windows = {l: 1 for l in range(layers)}
            self.allow_block_sharing = True
            self.group_cache_managers = [ns.FullAttentionCacheAllocator(0, block_size, allow_block_sharing=True)]
            self.num_full_attention_groups = 1
            self.num_sliding_attention_groups = 0
            self.max_sliding_window_blocks_per_request = 0
            self.max_blocks_per_request = 0
            self.use_prefix_sharing = True
            self._block_manager = ns.BlockManager(num_blocks, block_size, tp_on=False)
            self._total_prefix_length = 0

        def update(self, key_states, value_states, layer_idx, read_index, write_index):
            return key_states, value_states

    for f in funcs:
        setattr(PagedAttentionCache, f.name, glb[f.name])
    return PagedAttentionCache


def next_token(seq, vocab=997):
    """The fake model: the next token is a function of the sequence."""
    return int.from_bytes(hashlib.sha256(struct.pack("<%dI" % len(seq), *seq)).digest()[:4], "little") % vocab + 3


class _IO:
    compute_stream = None


class Processor:
    """What the tier sees of a ContinuousBatchProcessor, over transformers'
    own scheduler and offloading manager."""

    def __init__(self, ns, num_blocks, block_size, layers=2, max_batch_tokens=512, max_requests_per_batch=64):
        self.ns = ns
        self.cache = ns.PagedAttentionCache(num_blocks, block_size, layers, max_batch_tokens=max_batch_tokens)
        self.scheduler = ns.FIFOScheduler(self.cache, safety_margin=None,
                                          max_requests_per_batch=max_requests_per_batch)
        om = object.__new__(ns.OffloadingManager)  # its __init__ sizes a pinned pool: none here (cpu_offload_space=0)
        om.cache, om.scheduler, om._compute_stream = self.cache, self.scheduler, None
        om._cpu_key_cache, om._cpu_value_cache, om._gpu_key_views, om._gpu_value_views = [], [], [], []
        om._free_cpu_blocks, om._request_id_to_cpu_blocks, om._request_id_to_group_block_counts = [], {}, {}
        om._num_cpu_blocks = 0
        self.offloading_manager = om
        self.inputs_and_outputs = _IO()
        self.cb_config = None
        self.config = types.SimpleNamespace(_attn_implementation="paged|sdpa")


class Manager:
    """A ContinuousBatchingManager's attach points."""

    def __init__(self, make_processor):
        self._make = make_processor
        self.continuous_batching_config = types.SimpleNamespace(cpu_offload_space=0.0, allow_block_sharing=True)
        self.model = None
        self.batch_processor = None

    def _create_batch_processor(self):
        if self.batch_processor is None:
            self.batch_processor = self._make()
        return self.batch_processor


class Loop:
    """ContinuousBatchProcessor.prepare_next_batch + update_batch (sync
    mode, no logits processors), with the fake model."""

    def __init__(self, bp, gpu):
        self.bp, self.gpu = bp, gpu
        self.ns = bp.ns
        self.outputs = {}
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.batches = 0
        self.victims = set()
        self.misfed = []  # (request, position): tokens_to_process not the sequence's tokens there
        om = bp.offloading_manager
        orig = om._offload_to_cpu

        def off(victims):
            self.victims.update(s.request_id for s in victims)
            return orig(victims)

        om._offload_to_cpu = off

    def add(self, rid, tokens, new_tokens):
        st = self.ns.RequestState(request_id=rid, initial_tokens=list(tokens), max_new_tokens=new_tokens,
                                  eos_token_id=-1)
        self.bp.scheduler.add_waiting_request(st)

    def step(self):
        sched, om, cache = self.bp.scheduler, self.bp.offloading_manager, self.bp.cache
        rib, _, _, _ = sched.schedule_batch(cache.max_batch_tokens, cache.num_pages)
        while rib is None:
            if om.offload_requests() == 0:
                raise RuntimeError("No requests can be scheduled and no requests can be offloaded.")
            rib, _, _, _ = sched.schedule_batch(cache.max_batch_tokens, cache.num_pages)
        if not rib:
            return False
        if sched.starved_requests:
            om.offload_requests()
        om.restore_scheduled_requests(rib)
        self.batches += 1
        RS = self.ns.RequestStatus
        for fs in rib:  # prepare_batch_tensors and the forward
            st = fs.state
            past, q = st.position_offset, fs.query_length
            seq = st.initial_tokens + st.generated_tokens
            if st.tokens_to_process != seq[past:past + q]:
                self.misfed.append((st.request_id, past))
            table = cache.group_cache_managers[0].block_table[st.request_id]
            self.gpu.check(st.request_id, table, seq, past)
            self.gpu.write(table, seq, past, past + q)
            st.position_offset += q
            if st.generated_len() == 0:
                self.prefill_tokens += q
            else:
                self.decode_tokens += q
            if fs.has_new_token:
                st.tokens_to_process = [self.ns.TMP_TOKEN_ID]
        for fs in rib:  # update_batch
            st = fs.state
            if st.status in (RS.FINISHED, RS.PENDING):
                raise RuntimeError(f"Tried to update {st.status.name} request {st.request_id} in sync mode.")
            if fs.has_new_token:
                if st.generated_len() == 0:
                    st.status = RS.DECODING
                seq = st.initial_tokens + st.generated_tokens
                finished = st.update_and_check_completion(next_token(seq), None)
                cache.mark_shareable_blocks_as_complete(st, fs.complete_blocks)
                if finished:
                    sched.finish_request(st.request_id)
                    sched.block_new_requests = False
                    self.outputs[st.request_id] = st.to_generation_output().generated_tokens
            elif st.status == RS.PREFILLING:
                cache.mark_shareable_blocks_as_complete(st, fs.complete_blocks)
        return True

    def run(self, max_batches=100000):
        while self.bp.scheduler.has_pending_requests():
            if not self.step():
                break
            if self.batches > max_batches:
                raise RuntimeError("too many batches")
        return self.outputs
