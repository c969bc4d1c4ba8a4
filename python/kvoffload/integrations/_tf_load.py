"""The transformers tier's loads (a mixin of TransformersOffload): the
prefix lookup past the GPU, loads of full and partial blocks, and the
per-layer waits of the forward. The hooks call them with the tier's lock
held."""

import logging
import time

from ..errors import KvoError
from ..keys import block_key, chain_keys

logger = logging.getLogger("kvoffload.transformers")


from ._tf_common import _Entry, _prompt_ident


class _Loads:
    """Lookups and loads (see the module doc)."""

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
