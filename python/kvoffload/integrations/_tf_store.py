"""The transformers tier's stores (a mixin of TransformersOffload): the
ordering helpers, write-behind, store before eviction, and the swap of a
preempted request. The hooks call them with the tier's lock held."""

import itertools
import logging

from ..errors import KvoError
from ..keys import block_key, chain_keys

logger = logging.getLogger("kvoffload.transformers")


from ._tf_common import _Entry, _Tail


class _Stores:
    """Stores, evictions and swaps (see the module doc)."""

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
