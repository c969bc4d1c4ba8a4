"""Stand-ins for the few transformers 5.17 continuous-batching objects the
kvoffload tier touches, without torch: the same classes, method names and
signatures (checked by check_signatures), with the bodies of
BlockManager, FullAttentionCacheAllocator, PagedAttentionCache.search_prefix_match
and Scheduler._infer_request_tokens / _allocate_blocks_if_needed
following transformers 5.17 (Apache-2.0, generation/continuous_batching/)
line for line where the tier depends on their behaviour.

The KV of the fake model lives in a host engine's simulated GPU memory:
token t of a sequence writes, in every layer's K and V, bytes that depend
on the tokens up to t (as a real model's KV does), so a test can check
that every block a request reads holds exactly what computing it would
have written (kv_bytes)."""

import hashlib
import struct
from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum

import kvoffload


class RequestStatus(IntEnum):
    PENDING = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED = 3
    FAILED = 4


@dataclass
class RequestState:
    request_id: str
    initial_tokens: list
    max_new_tokens: int = 20
    tokens_to_process: list = field(default_factory=list)
    generated_tokens: list = field(default_factory=list)
    position_offset: int = 0
    allocated_blocks: int = 0
    _status: RequestStatus = RequestStatus.PENDING
    _true_initial_tokens: int = 0
    remaining_prefill_tokens: list = field(default_factory=list)
    is_cpu_offloaded: bool = False

    def __post_init__(self):
        self.remaining_prefill_tokens = self.initial_tokens[:]

    @property
    def status(self):
        return self._status

    @status.setter
    def status(self, value):
        self._status = value

    def current_len(self):
        return self.position_offset

    def create_equivalent_initial_request(self):
        new = RequestState(request_id=self.request_id, initial_tokens=self.initial_tokens + self.generated_tokens,
                           max_new_tokens=self.max_new_tokens - len(self.generated_tokens))
        new._true_initial_tokens = self._true_initial_tokens or len(self.initial_tokens)
        return new


class Block:
    def __init__(self, id_, parent_id, group_id):
        self.id = id_
        self.parent_id = parent_id
        self.group_id = group_id
        self.hash = None
        self.ref_count = 1

    @property
    def is_complete(self):
        return self.hash is not None


class BlockManager:
    def __init__(self, num_blocks, block_size, tp_on):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tp_on = tp_on
        self._uninit_block_ids = deque(range(num_blocks))
        self._init_block_ids = {}
        self._hash_to_id = {}
        self._id_to_block = {}

    @property
    def num_free_blocks(self):
        return len(self._uninit_block_ids) + len(self._init_block_ids)

    def has_enough_free_blocks(self, n_blocks):
        if len(self._uninit_block_ids) >= n_blocks:
            return True
        block_to_uninitialize = n_blocks - len(self._uninit_block_ids)
        if len(self._init_block_ids) < block_to_uninitialize:
            return False
        for _ in range(block_to_uninitialize):
            id_to_uninitialize = self._init_block_ids.popitem()[0]
            block = self._id_to_block[id_to_uninitialize]
            self._hash_to_id.pop(block.hash)
            self._uninit_block_ids.append(id_to_uninitialize)
        return True

    def get_free_blocks(self, n_blocks, last_block_id, shareable, group_id):
        if not self.has_enough_free_blocks(n_blocks):
            return None
        allocated_block_ids = [self._uninit_block_ids.popleft() for _ in range(n_blocks)]
        if shareable:
            for block_id in allocated_block_ids:
                block = Block(block_id, last_block_id, group_id)
                self._id_to_block[block_id] = block
                last_block_id = block_id
        return allocated_block_ids

    def increase_ref_count(self, block_id):
        block = self._id_to_block[block_id]
        block.ref_count += 1
        if block.ref_count == 1:
            self._init_block_ids.pop(block_id)

    def decrease_ref_count(self, block_id):
        block = self._id_to_block[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.is_complete:
                self._init_block_ids[block_id] = None
            else:
                self._id_to_block.pop(block_id)
                self._uninit_block_ids.append(block_id)

    def free_blocks(self, blocks, shareable):
        if shareable:
            for block_id in blocks:
                self.decrease_ref_count(block_id)
        else:
            self._uninit_block_ids.extend(blocks)

    def uninitialize_unshared_block(self, block_id):
        block = self._id_to_block.pop(block_id)
        if block.ref_count > 1:
            raise RuntimeError(f"Block {block_id} has more than one reference: {block.ref_count = }")
        self._uninit_block_ids.append(block_id)

    def mark_shareable_blocks_as_complete(self, num_complete_blocks, allocated_blocks, prompt_ids):
        parent_hash = None
        incomplete_blocks = []
        for i in range(len(allocated_blocks) - 1, -1, -1):
            block = self._id_to_block[allocated_blocks[i]]
            if block.is_complete:
                parent_hash = block.hash
                break
            incomplete_blocks.append((i, block))
        new_parent_id = None
        while incomplete_blocks:
            i, block = incomplete_blocks.pop()
            if new_parent_id is not None:
                block.parent_id = new_parent_id
                new_parent_id = None
            if num_complete_blocks == 0:
                break
            num_complete_blocks -= 1
            tokens = prompt_ids[i * self.block_size:(i + 1) * self.block_size]
            block.hash = self.compute_hash(parent_hash, tokens, block.group_id)
            existing_block_id = self._hash_to_id.get(block.hash)
            if existing_block_id is not None:
                if existing_block_id != block.id:
                    allocated_blocks[i] = existing_block_id
                    new_parent_id = existing_block_id
                    self.increase_ref_count(existing_block_id)
                    self.uninitialize_unshared_block(block.id)
            else:
                self._hash_to_id[block.hash] = block.id
            parent_hash = block.hash

    def compute_hash(self, parent_hash, tokens, group_id):
        return hash((parent_hash, tuple(tokens), group_id))


class FullAttentionCacheAllocator:
    def __init__(self, index, block_size, allow_block_sharing):
        self._index = index
        self.uses_block_sharing = allow_block_sharing
        self.block_size = block_size
        self.block_table = {}

    def allocate_blocks(self, n_blocks, request_id, block_manager):
        block_table = self.block_table.get(request_id, [])
        if block_table:
            last_block_id = block_table[-1]
        else:
            self.block_table[request_id] = block_table
            last_block_id = None
        allocated_blocks = block_manager.get_free_blocks(n_blocks, last_block_id, self.uses_block_sharing, self._index)
        if allocated_blocks is None:
            return None
        block_table.extend(allocated_blocks)
        return n_blocks

    def free_blocks(self, request_id, block_manager):
        if request_id in self.block_table:
            block_manager.free_blocks(self.block_table.pop(request_id), shareable=self.uses_block_sharing)


class PagedAttentionCache:
    def __init__(self, num_blocks, block_size, layers, kv_heads=2, head_dim=8, dtype="bfloat16",
                 allow_block_sharing=True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.num_key_value_heads = kv_heads
        self.head_dim = head_dim
        self.key_cache = [None] * layers
        self.value_cache = [None] * layers
        self.num_groups = 1
        self.num_sliding_attention_groups = 0
        self.layer_index_to_group_indices = {l: (0, l) for l in range(layers)}
        self.allow_block_sharing = allow_block_sharing
        self.use_prefix_sharing = allow_block_sharing
        self.group_cache_managers = [FullAttentionCacheAllocator(0, block_size, allow_block_sharing)]
        self._block_manager = BlockManager(num_blocks, block_size, tp_on=False)
        self._total_prefix_length = 0

    def get_num_free_blocks(self):
        return self._block_manager.num_free_blocks

    def allocate_blocks(self, n_blocks, request_id, allocated_blocks):
        if n_blocks > self.get_num_free_blocks():
            return None
        out = 0
        for cm in self.group_cache_managers:
            got = cm.allocate_blocks(n_blocks, request_id, self._block_manager)
            if got is None:
                raise ValueError(f"Failed to allocate {n_blocks} blocks for request {request_id}")
            out = max(out, got)
        return out

    def free_blocks(self, request_id):
        for cm in self.group_cache_managers:
            cm.free_blocks(request_id, self._block_manager)

    def search_prefix_match(self, request_id, prompt_ids):
        current_hash = None
        allocated_blocks = []
        for b in range(len(prompt_ids) // self.block_size):
            tokens = prompt_ids[b * self.block_size:(b + 1) * self.block_size]
            current_hash = self._block_manager.compute_hash(current_hash, tokens, group_id=0)
            block_id = self._block_manager._hash_to_id.get(current_hash)
            if block_id is not None:
                allocated_blocks.append(block_id)
                self._block_manager.increase_ref_count(block_id)
            else:
                break
        if allocated_blocks:
            self.group_cache_managers[0].block_table[request_id] = allocated_blocks
        prefix_length = len(allocated_blocks) * self.block_size
        self._total_prefix_length += prefix_length
        return prefix_length

    def mark_shareable_blocks_as_complete(self, state, num_complete_blocks):
        if num_complete_blocks == 0 or state.status == RequestStatus.FINISHED:
            return None
        for cm in self.group_cache_managers:
            if cm.uses_block_sharing:
                self._block_manager.mark_shareable_blocks_as_complete(
                    num_complete_blocks=num_complete_blocks, allocated_blocks=cm.block_table[state.request_id],
                    prompt_ids=(state.initial_tokens + state.generated_tokens))

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        return key_states, value_states


class Scheduler:
    def __init__(self, cache):
        self.cache = cache
        self.active_requests = {}
        self.waiting_requests = {}

    def finish_request(self, request_id):
        self.cache.free_blocks(request_id)
        self.active_requests.pop(request_id, None)

    def _allocate_blocks_if_needed(self, state, len_next_tokens):
        current_len = state.current_len()
        occupancy = state.allocated_blocks * self.cache.block_size - current_len
        if occupancy < len_next_tokens or state.allocated_blocks == 0:
            blocks_needed = ((len_next_tokens - occupancy + 1) // self.cache.block_size) + 1
            allocated = self.cache.allocate_blocks(blocks_needed, state.request_id, state.allocated_blocks)
            if allocated is None:
                return False
            state.allocated_blocks += allocated
        return True

    def _infer_request_tokens(self, state, request_ids_to_remove_from_waiting):
        if self.cache.use_prefix_sharing and state.status == RequestStatus.PENDING and not state.is_cpu_offloaded:
            prefill_length = self.cache.search_prefix_match(state.request_id, state.remaining_prefill_tokens)
            if prefill_length > 0:
                self.active_requests[state.request_id] = state
                request_ids_to_remove_from_waiting.add(state.request_id)
                state.status = RequestStatus.PREFILLING
                state.allocated_blocks += prefill_length // self.cache.block_size
                prefill_length = min(prefill_length, len(state.remaining_prefill_tokens) - 1)
                state.remaining_prefill_tokens = state.remaining_prefill_tokens[prefill_length:]
                state.position_offset += prefill_length
        if state.status == RequestStatus.DECODING:
            return state.tokens_to_process
        return state.remaining_prefill_tokens


class OffloadingManager:
    """5.17's offload_requests for one victim, with no CPU pool (the
    default cpu_offload_space=0): what is not CPU-offloaded is soft reset."""

    def __init__(self, cache, scheduler):
        self.cache = cache
        self.scheduler = scheduler

    def _offload_to_cpu(self, victims):
        return set()

    def offload(self, state):
        """Evicts state; returns the state that is requeued."""
        offloaded = self._offload_to_cpu([state])
        assert not offloaded
        new_state = state.create_equivalent_initial_request()
        state._status = RequestStatus.FINISHED
        self.scheduler.finish_request(state.request_id)
        return new_state


class _IO:
    compute_stream = None


class ContinuousBatchProcessor:
    def __init__(self, cache):
        self.cache = cache
        self.scheduler = Scheduler(cache)
        self.offloading_manager = OffloadingManager(cache, self.scheduler)
        self.inputs_and_outputs = _IO()
        self.cb_config = None


@dataclass
class ContinuousBatchingConfig:
    block_size: int = 256
    allow_block_sharing: bool = True
    cpu_offload_space: float = 0.0


class ContinuousBatchingManager:
    def __init__(self, cache_factory, cb_config=None, model=None):
        self._cache_factory = cache_factory
        self.continuous_batching_config = cb_config or ContinuousBatchingConfig()
        self.model = model
        self.batch_processor = None

    def _create_batch_processor(self):
        if self.batch_processor is not None:
            return self.batch_processor
        self.batch_processor = ContinuousBatchProcessor(self._cache_factory())
        return self.batch_processor


class ContinuousMixin:
    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, workload_hints=None):
        return ContinuousBatchingManager(self.cache_factory, continuous_batching_config, model=self)


class FakeConfig:
    def __init__(self, layers=2, layer_types=None, sliding_window=None, name=""):
        self.num_hidden_layers = layers
        if layer_types is not None:
            self.layer_types = layer_types
        self.sliding_window = sliding_window
        self._name_or_path = name

    def get_text_config(self):
        return self


class FakeModel(ContinuousMixin):
    def __init__(self, config, cache_factory):
        self.config = config
        self.cache_factory = cache_factory


CLASSES = {
    "BlockManager": BlockManager,
    "PagedAttentionCache": PagedAttentionCache,
    "Scheduler": Scheduler,
    "OffloadingManager": OffloadingManager,
    "ContinuousBatchingManager": ContinuousBatchingManager,
    "ContinuousMixin": ContinuousMixin,
}


# ---- the fake model's KV in simulated GPU memory --------------------------

def host_engine_factory(pool_blocks=64):
    """An engine_factory giving a host engine over a layout that matches the
    fake cache (dtype 2 bytes)."""
    def make(cache, namespace):
        blk = max(4096, cache.block_size * cache.num_key_value_heads * cache.head_dim * 2 * 2 * len(cache.key_cache))
        cfg = {
            "pool_bytes": pool_blocks * blk, "first_region_bytes": pool_blocks * blk, "backend": "host",
            "skip_memory_check": True, "policy": "lru", "staging_bytes": 1 << 16, "namespace": namespace,
            "layout": {"kind": "layer-separate", "layers": len(cache.key_cache), "kv_heads": cache.num_key_value_heads,
                       "head_dim": cache.head_dim, "dtype_bytes": 2, "tokens_per_block": cache.block_size,
                       "num_blocks": cache.num_blocks},
        }
        return kvoffload.Engine(cfg)
    return make


def token_kv(tokens, pos, layer, kv, slot):
    """The bytes the fake model writes for token pos of tokens in (layer,
    K or V): a function of tokens[:pos + 1]."""
    return _kv_bytes(_prefix_hashes(tokens, pos + 1)[pos], layer, kv, slot)


def _prefix_hashes(tokens, n, start=None):
    """h[p] = SHA-256(h[p-1] || token p), for p < n (start: hashes already
    computed for a prefix of tokens)."""
    out = list(start or [])
    prev = out[-1] if out else b""
    for p in range(len(out), n):
        prev = hashlib.sha256(prev + struct.pack("<I", tokens[p])).digest()
        out.append(prev)
    return out


def _kv_bytes(h, layer, kv, slot):
    d = hashlib.sha256(h + struct.pack("<II", layer, kv)).digest()
    return (d * (slot // len(d) + 1))[:slot]


class FakeGPU:
    """Writes and checks the fake model's KV in an engine's simulated GPU.
    check_every: check one position in that many (and the first and last
    of each block), to keep long sequences quick."""

    def __init__(self, engine, cache, check_every=1):
        self.eng = engine
        self.cache = cache
        self.slot = cache.num_key_value_heads * cache.head_dim * 2
        self.check_every = check_every
        self.computed = 0  # tokens computed (written) by forward()
        self.bad = []  # (request, position) whose cached KV was wrong
        self._memo = {}  # first token ids -> (tokens, prefix hashes)
        self._layers = self.eng.config["layout"]["layer_tensors"]

    def _hashes(self, tokens, n):
        key = tuple(tokens[:8])
        got = self._memo.get(key)
        if got is not None and len(got[0]) <= len(tokens) and tokens[:len(got[0])] == got[0]:
            hs = got[1]
            if len(hs) >= n:
                return hs
            hs = _prefix_hashes(tokens, n, hs)
        else:
            hs = _prefix_hashes(tokens, n)
        self._memo[key] = (list(tokens[:n]), hs)
        return hs

    def _addr(self, layer, kv, block, offset):
        t = self._layers[layer]
        return (t["k"] if kv == 0 else t["v"]) + block * t["stride"] + offset * self.slot

    def write(self, table, tokens, start, end):
        bs = self.cache.block_size
        hs = self._hashes(tokens, end)
        for pos in range(start, end):
            b, o = table[pos // bs], pos % bs
            for layer in range(len(self.cache.key_cache)):
                for kv in (0, 1):
                    self.eng.sim_write(self._addr(layer, kv, b, o), _kv_bytes(hs[pos], layer, kv, self.slot))
        self.computed += end - start

    def check(self, rid, table, tokens, end):
        """Checks that positions [0, end) of the request's blocks hold the
        KV of tokens (what attention reads)."""
        bs = self.cache.block_size
        if end <= 0:
            return True
        hs = self._hashes(tokens, end)
        for pos in range(end):
            if pos % self.check_every and pos % bs not in (0, bs - 1) and pos != end - 1:
                continue
            b, o = table[pos // bs], pos % bs
            for layer in range(len(self.cache.key_cache)):
                for kv in (0, 1):
                    if self.eng.sim_read(self._addr(layer, kv, b, o), self.slot) != _kv_bytes(hs[pos], layer, kv,
                                                                                              self.slot):
                        self.bad.append((rid, pos))
                        return False
        return True


def step(bp, gpu, state):
    """One scheduling + forward + update of one request, as 5.17's
    _process_candidates / prepare_batch_tensors / update_batch do it
    (token budget unlimited: the whole remaining prefill at once). Returns
    the number of tokens computed."""
    sched, cache = bp.scheduler, bp.cache
    tokens = sched._infer_request_tokens(state, set())
    n = len(tokens)
    if not sched._allocate_blocks_if_needed(state, n):
        raise RuntimeError(f"no room for {state.request_id}")
    if state.status == RequestStatus.PENDING:
        sched.active_requests[state.request_id] = state
    if state.status <= RequestStatus.PREFILLING:
        state.tokens_to_process = state.remaining_prefill_tokens
        state.remaining_prefill_tokens = []
        state.status = RequestStatus.DECODING
    tokens_in_current_block = state.current_len() % cache.block_size
    complete_blocks = (tokens_in_current_block + n) // cache.block_size
    seq = state.initial_tokens + state.generated_tokens
    table = cache.group_cache_managers[0].block_table[state.request_id]
    past = state.position_offset
    gpu.check(state.request_id, table, seq, past)
    gpu.write(table, seq, past, past + n)
    state.position_offset += n
    # The "model": the next token is a function of the sequence.
    nxt = (sum(seq) * 31 + len(seq)) % 997 + 1
    state.generated_tokens.append(nxt)
    state.tokens_to_process = [nxt]
    cache.mark_shareable_blocks_as_complete(state, complete_blocks)
    return n


def run(bp, gpu, state, new_tokens):
    """Runs a request until new_tokens more tokens are generated; returns
    the tokens computed."""
    done = 0
    target = len(state.generated_tokens) + new_tokens
    while len(state.generated_tokens) < target:
        done += step(bp, gpu, state)
    return done


def finish(bp, state):
    state.status = RequestStatus.FINISHED
    bp.scheduler.finish_request(state.request_id)
