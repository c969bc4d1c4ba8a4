"""kvoffload.integrations.transformers without torch or transformers: the
hooks on fakes of transformers 5.17's continuous batching (tf_fakes), a
host engine, and the fake model's KV in its simulated GPU. What a GPU run
checks on the real thing is in bench/transformers_cb.py."""

import unittest

import kvoffload
from kvoffload.integrations import transformers as kvt

from . import tf_fakes as F
from .helpers import needs_library

BS = 4  # block size (transformers' minimum)


class Versions(unittest.TestCase):
    def test_supported(self):
        self.assertEqual(kvt.check_version("5.17.0", env={}), (5, 17))
        self.assertEqual(kvt.check_version("5.17.3.dev0", env={}), (5, 17))

    def test_refused(self):
        for v in ("5.16.2", "5.18.0", "4.57.1", "6.0.0"):
            with self.assertRaises(kvt.UnsupportedVersionError) as cm:
                kvt.check_version(v, env={})
            self.assertIn("supports transformers 5.17.x", str(cm.exception))
            self.assertIn(v, str(cm.exception))
        with self.assertRaises(kvt.UnsupportedVersionError):
            kvt.check_version("garbage", env={})

    def test_untested_override_warns(self):
        with self.assertLogs("kvoffload.transformers", "WARNING"):
            self.assertEqual(kvt.check_version("5.18.0", env={kvt.UNTESTED_ENV: "1"}), (5, 18))

    def test_signatures_of_the_fakes(self):
        kvt.check_signatures(F.CLASSES)  # the fakes follow 5.17

    def test_signature_drift_refused(self):
        class Drifted(F.BlockManager):
            def has_enough_free_blocks(self, n_blocks, group_id):
                return True

        classes = dict(F.CLASSES, BlockManager=Drifted)
        with self.assertRaises(kvt.UnsupportedVersionError) as cm:
            kvt.check_signatures(classes)
        self.assertIn("BlockManager.has_enough_free_blocks", str(cm.exception))
        classes = dict(F.CLASSES)
        del classes["OffloadingManager"]
        with self.assertRaises(kvt.UnsupportedVersionError) as cm:
            kvt.check_signatures(classes)
        self.assertIn("OffloadingManager._offload_to_cpu is missing", str(cm.exception))


class LayerGroups(unittest.TestCase):
    def test_full_attention_is_one_group(self):
        groups, types = kvt.check_model_config(F.FakeConfig(layers=4))
        self.assertEqual(groups, [[0, 1, 2, 3]])
        self.assertEqual(types, ["full_attention"])

    def test_sliding_window_refused(self):
        cfg = F.FakeConfig(layers=8, layer_types=["sliding_attention", "full_attention", "full_attention",
                                                  "sliding_attention", "full_attention", "full_attention",
                                                  "full_attention", "full_attention"], sliding_window=128)
        groups, _ = kvt.layer_groups(cfg)
        self.assertEqual(groups, [[0, 3], [1, 2], [4, 5], [6, 7]])  # 5.17's own example
        with self.assertRaises(kvt.UnsupportedModelError) as cm:
            kvt.check_model_config(cfg)
        self.assertIn("sliding_attention", str(cm.exception))
        with self.assertRaises(kvt.UnsupportedModelError):  # sliding_window alone: every layer slides
            kvt.check_model_config(F.FakeConfig(layers=2, sliding_window=64))

    def test_sliding_model_refused_at_attach(self):
        model = F.FakeModel(F.FakeConfig(layers=2, layer_types=["sliding_attention", "full_attention"],
                                         sliding_window=8), cache_factory=None)
        with self.assertRaises(kvt.UnsupportedModelError):
            kvt.attach(model, pool_bytes=1 << 20, check=False, model_id="m")
        self.assertNotIn("init_continuous_batching", vars(model))  # nothing installed

    def test_namespaces(self):
        ns = kvt.model_namespace("org/model@abc", "torch.bfloat16", 256, 8, 128, 32)
        self.assertEqual(ns, "transformers-cb/org/model@abc/bfloat16/bs256/kv8x128/L32")
        g0, g1 = kvt.group_namespace(ns, 0), kvt.group_namespace(ns, 1)
        self.assertNotEqual(g0, g1)
        toks = list(range(512))
        self.assertNotEqual(kvoffload.chain_keys(toks, 256, g0), kvoffload.chain_keys(toks, 256, g1))
        for other in (kvt.model_namespace("org/model@abc", "torch.float16", 256, 8, 128, 32),
                      kvt.model_namespace("org/model@abc", "torch.bfloat16", 128, 8, 128, 32),
                      kvt.model_namespace("org/other", "torch.bfloat16", 256, 8, 128, 32)):
            self.assertNotEqual(kvoffload.chain_keys(toks, 256, kvt.group_namespace(other, 0))[0],
                                kvoffload.chain_keys(toks, 256, g0)[0])

    def test_unnamed_model_warns(self):
        with self.assertLogs("kvoffload.transformers", "WARNING"):
            a = kvt.default_model_id(F.FakeModel(F.FakeConfig(), None))
        self.assertTrue(a.startswith("unnamed-"))
        self.assertEqual(kvt.default_model_id(F.FakeModel(F.FakeConfig(name="org/m"), None)), "org/m")


class Configs(unittest.TestCase):
    def manager(self, **cfg):
        return F.ContinuousBatchingManager(None, F.ContinuousBatchingConfig(**cfg),
                                           model=F.FakeModel(F.FakeConfig(), None))

    def test_own_cpu_pool_refused(self):
        for space in (4.0, None):
            with self.assertRaises(kvt.UnsupportedConfigError) as cm:
                kvt.attach(self.manager(cpu_offload_space=space), pool_bytes=1 << 20, check=False, model_id="m")
            self.assertIn("cpu_offload_space", str(cm.exception))

    def test_cuda_graphs_refused(self):
        for on in (True, (True, False), (False, True)):
            m = self.manager()
            m.continuous_batching_config.use_cuda_graph = on
            with self.assertRaises(kvt.UnsupportedConfigError) as cm:
                kvt.attach(m, pool_bytes=1 << 20, check=False, model_id="m")
            self.assertIn("use_cuda_graph", str(cm.exception))
        for off in (False, None, (False, False)):
            kvt.check_no_cuda_graphs(off)

    def test_block_sharing_required(self):
        with self.assertRaises(kvt.UnsupportedConfigError):
            kvt.attach(self.manager(allow_block_sharing=False), pool_bytes=1 << 20, check=False, model_id="m")

    def test_bad_pool_size_refused(self):
        for bad in (0, -1, 1.5, "1GiB", True):
            with self.assertRaises(ValueError, msg=repr(bad)) as cm:
                kvt.attach(self.manager(), pool_bytes=bad, check=False)
            self.assertIn(repr(bad), str(cm.exception))

    def test_default_pool_from_the_gpu_cache(self):
        cache = F.PagedAttentionCache(num_blocks=40, block_size=256, layers=32, kv_heads=8, head_dim=128)
        self.assertEqual(kvt.cache_bytes(cache), 40 * 256 * 8 * 128 * 2 * 32 * 2)
        self.assertEqual(kvt.default_pool_bytes(kvt.cache_bytes(cache)), kvt.POOL_CACHES * kvt.cache_bytes(cache))
        self.assertEqual(kvt.default_pool_bytes(4096), kvt.MIN_POOL_BYTES)

    def test_wrong_target(self):
        with self.assertRaises(TypeError):
            kvt.attach(object(), pool_bytes=1 << 20, check=False)


@needs_library
class Hooks(unittest.TestCase):
    """The tier on the fakes, end to end: blocks stored at eviction, the
    prefix lookup loading what the GPU lost, preemption, with every block a
    request reads checked against what computing it writes. Stores at
    eviction and swap only (write_behind=False): the eviction path itself;
    HooksWriteBehind runs the default."""

    WRITE_BEHIND = False

    def assert_evicted_in_pool(self, st, n):
        """At least n evicted blocks were stored as they were evicted."""
        self.assertGreaterEqual(st.get("evict_store_blocks", 0), n)
        self.assertEqual(st.get("store_stored", 0), st["evict_store_blocks"])

    def assert_swapped(self, st, full, partial):
        """A swap stored full + partial blocks."""
        self.assertEqual(st.get("swap_store_blocks", 0), full + partial)

    def setUp(self):
        self.caches = []

        def cache_factory():
            c = F.PagedAttentionCache(num_blocks=self.num_blocks, block_size=BS, layers=2)
            self.caches.append(c)
            return c

        self.num_blocks = 12
        self.model = F.FakeModel(F.FakeConfig(layers=2, name="fake/llama"), cache_factory)
        self.tier = kvt.attach(self.model, engine_factory=F.host_engine_factory(64), check=False,
                               write_behind=self.WRITE_BEHIND)
        self.addCleanup(self.tier.close)
        self.manager = self.model.init_continuous_batching()
        self.bp = self.manager._create_batch_processor()
        self.cache = self.bp.cache
        self.gpu = F.FakeGPU(self.tier.engine, self.cache)

    def req(self, rid, tokens, new=2):
        st = F.RequestState(rid, list(tokens), max_new_tokens=new)
        computed = F.run(self.bp, self.gpu, st, new)
        return st, computed

    def test_hooks_installed_and_removed(self):
        bm = self.cache._block_manager
        for obj, name in ((bm, "has_enough_free_blocks"), (bm, "mark_shareable_blocks_as_complete"),
                          (self.cache, "search_prefix_match"), (self.bp.scheduler, "_infer_request_tokens"),
                          (self.bp.offloading_manager, "_offload_to_cpu"), (self.manager, "_create_batch_processor"),
                          (self.model, "init_continuous_batching")):
            self.assertIn(name, vars(obj), name)
        self.assertNotIn("update", vars(self.cache))  # no per-layer loads without a CUDA stream
        self.assertEqual(self.tier.namespace, "transformers-cb/fake/llama/bfloat16/bs4/kv2x8/L2")
        self.tier.close()
        for obj in (bm, self.cache, self.bp.scheduler, self.bp.offloading_manager, self.manager, self.model):
            self.assertFalse([n for n in vars(obj) if n in ("has_enough_free_blocks", "search_prefix_match",
                                                            "_infer_request_tokens", "_offload_to_cpu",
                                                            "_create_batch_processor", "init_continuous_batching",
                                                            "mark_shareable_blocks_as_complete", "_kvo_tier")])
        self.assertTrue(self.tier.engine.closed)

    def test_same_processor_reused(self):
        n = self.tier.counters["processors"]
        self.assertIs(self.manager._create_batch_processor(), self.bp)
        self.assertEqual(self.tier.counters["processors"], n)

    def test_keys_are_chain_keys(self):
        prefix = list(range(100, 100 + 3 * BS))
        st, _ = self.req("a", prefix + [7, 8], new=1)
        table = self.cache.group_cache_managers[0].block_table["a"]
        want = kvoffload.chain_keys(prefix, BS, namespace=self.tier.key_namespace)
        self.assertEqual([self.tier._keys[b].key for b in table[:3]], want)
        self.assertEqual(self.tier.key_namespace, self.tier.namespace + "/g0")

    def test_evicted_prefix_is_loaded_not_recomputed(self):
        prefix = list(range(1000, 1000 + 4 * BS))  # 4 blocks
        a, computed = self.req("a", prefix + [1, 2, 3], new=2)
        self.assertEqual(computed, len(prefix) + 3 + 1)
        F.finish(self.bp, a)
        # Another request takes every block: a's cached blocks are evicted (stored first).
        other = list(range(5000, 5000 + 11 * BS))
        b, _ = self.req("b", other, new=1)
        F.finish(self.bp, b)
        self.assertEqual(self.cache._block_manager._hash_to_id.keys() & set(), set())
        st = self.tier.stats()
        self.assert_evicted_in_pool(st, 4)
        # The same prefix again: none of it on the GPU, all of it in kvoffload.
        before = self.gpu.computed
        c, computed = self.req("c", prefix + [9, 9, 9], new=1)
        self.assertEqual(computed, 3, "only the new tokens are computed")
        self.assertEqual(self.gpu.bad, [])
        st = self.tier.stats()
        self.assertEqual(st["kvo_prefix_blocks"], 4)
        self.assertEqual(st.get("load_loaded", 0), 4)
        self.assertEqual(self.gpu.computed - before, 3)
        # The loaded blocks joined transformers' GPU index: a fourth request shares them.
        F.finish(self.bp, c)
        d, computed = self.req("d", prefix + [4, 4], new=1)
        self.assertEqual(computed, 2)
        self.assertEqual(self.tier.stats()["kvo_prefix_blocks"], 4)  # nothing more loaded
        self.assertEqual(self.gpu.bad, [])

    def test_mixed_gpu_kvoffload_new(self):
        prefix = list(range(2000, 2000 + 6 * BS))  # 6 blocks
        a, _ = self.req("a", prefix + [1], new=1)
        F.finish(self.bp, a)
        # Take just enough blocks that the tail of a's prefix is evicted (last freed first).
        bm = self.cache._block_manager
        free_uninit = len(bm._uninit_block_ids)
        evict = 3
        filler = list(range(7000, 7000 + (free_uninit + evict) * BS - 2))
        f, _ = self.req("f", filler, new=1)
        self.assert_evicted_in_pool(self.tier.stats(), 1)
        # The same prefix plus new tokens: the head is on the GPU, the rest in kvoffload.
        F.finish(self.bp, f)
        c, computed = self.req("c", prefix + [5, 6, 7, 8, 9], new=1)
        st = self.tier.stats()
        self.assertGreater(st["gpu_prefix_blocks"], 0)
        self.assertGreater(st["kvo_prefix_blocks"], 0)
        self.assertEqual(computed, 5, "the GPU part is shared, the kvoffload part loaded, the new part computed")
        self.assertEqual(self.gpu.bad, [])

    def test_reused_request_id_gets_its_own_keys(self):
        # A waiting request's keys are kept between lookups; a new prompt under the same id (same length,
        # same first and last tokens, as chat templates make them) must not reuse them.
        p1 = [1, 2, 3, 4] + list(range(100, 100 + 3 * BS)) + [7, 8, 9, 10]
        p2 = [1, 2, 3, 4] + list(range(200, 200 + 3 * BS)) + [7, 8, 9, 10]
        k1 = self.tier._prompt_keys("x", p1, 4)
        self.assertEqual(self.tier._prompt_keys("x", list(p1), 4), k1)
        k2 = self.tier._prompt_keys("x", p2, 4)
        self.assertEqual(k2, kvoffload.chain_keys(p2[:4 * BS], BS, namespace=self.tier.key_namespace))
        self.assertNotEqual(k1, k2)

    def test_gap_in_the_middle(self):
        prefix = list(range(2500, 2500 + 6 * BS))
        a, _ = self.req("a", prefix + [1], new=1)
        table = list(self.cache.group_cache_managers[0].block_table["a"])
        F.finish(self.bp, a)
        bm = self.cache._block_manager
        # Make a's third block the next one evicted (last freed), then take exactly one cached block.
        bm._init_block_ids.pop(table[2])
        bm._init_block_ids[table[2]] = None
        held = bm.get_free_blocks(len(bm._uninit_block_ids) + 1, None, True, 0)
        self.assertNotIn(table[2], bm._init_block_ids)
        self.assertIn(table[3], bm._init_block_ids)
        bm.free_blocks(held, True)  # incomplete: uninitialized again
        # GPU: blocks 0-1, kvoffload: block 2, GPU again: blocks 3-5, new: the rest.
        c, computed = self.req("c", prefix + [5, 6, 7], new=1)
        s = self.tier.stats()
        self.assertEqual((s["gpu_prefix_blocks"], s["kvo_prefix_blocks"], s["gpu_after_gap_blocks"]), (2, 1, 3))
        self.assertEqual(computed, 3)
        self.assertEqual(self.gpu.bad, [])

    def test_prefix_past_last_token_is_computed(self):
        prefix = list(range(3000, 3000 + 3 * BS))
        a, _ = self.req("a", prefix, new=1)
        F.finish(self.bp, a)
        b, _ = self.req("b", list(range(9000, 9000 + 11 * BS)), new=1)
        F.finish(self.bp, b)
        # A prompt that is exactly the stored blocks: the last block is not loaded (its last token is computed).
        c, computed = self.req("c", prefix, new=1)
        self.assertEqual(self.tier.stats()["kvo_prefix_blocks"], 2)
        self.assertEqual(computed, BS)
        self.assertEqual(self.gpu.bad, [])

    def test_preempted_request_resumes_with_its_blocks(self):
        prompt = list(range(4000, 4000 + 2 * BS + 2))  # 2 full blocks + 2 tokens
        st = F.RequestState("v", prompt, max_new_tokens=8)
        F.run(self.bp, self.gpu, st, 3)  # 3 generated: KV of prompt + 2 of them
        self.assertEqual(st.position_offset, len(prompt) + 2)
        new_state = self.bp.offloading_manager.offload(st)  # preemption: stored, then soft reset
        s = self.tier.stats()
        self.assertEqual(s["swapped_requests"], 1)
        self.assert_swapped(s, full=3, partial=0)  # 3 full blocks (12 tokens) + a partial one (0 tokens: none)
        # Fill the GPU so that nothing of v stays there.
        b, _ = self.req("b", list(range(8000, 8000 + 11 * BS)), new=1)
        F.finish(self.bp, b)
        self.assertEqual(new_state.initial_tokens, prompt + st.generated_tokens)
        before = self.gpu.computed
        F.run(self.bp, self.gpu, new_state, 1)
        self.assertEqual(self.gpu.computed - before, 1, "only the last token is computed again")
        self.assertEqual(self.gpu.bad, [])
        s = self.tier.stats()
        self.assertEqual(s["kvo_prefix_blocks"], 3)
        self.assertEqual((s["resumed"], s.get("resumed_partly", 0)), (1, 0))

    def test_preempted_partial_block_is_restored(self):
        prompt = list(range(4500, 4500 + 2 * BS + 1))  # 9 tokens
        st = F.RequestState("v", prompt, max_new_tokens=8)
        F.run(self.bp, self.gpu, st, 2)  # KV of 10 tokens: 2 full blocks + 2 in the third
        self.assertEqual(st.position_offset, 10)
        new_state = self.bp.offloading_manager.offload(st)
        s = self.tier.stats()
        self.assert_swapped(s, full=2, partial=1)
        b, _ = self.req("b", list(range(8000, 8000 + 11 * BS)), new=1)
        F.finish(self.bp, b)
        before = self.gpu.computed
        F.run(self.bp, self.gpu, new_state, 3)
        s = self.tier.stats()
        self.assertEqual(s["tail_blocks"], 1)
        self.assertEqual(s["resumed"], 1)
        # 1 token to resume (the last generated one), then 2 decode steps.
        self.assertEqual(self.gpu.computed - before, 3)
        self.assertEqual(self.gpu.bad, [])
        # The request's tokens are those of an uninterrupted run.
        ref = F.RequestState("r", prompt, max_new_tokens=8)
        other = F.ContinuousBatchProcessor(F.PagedAttentionCache(num_blocks=40, block_size=BS, layers=2))
        eng = F.host_engine_factory(8)(other.cache, "ref")
        self.addCleanup(eng.close)
        F.run(other, F.FakeGPU(eng, other.cache), ref, 5)
        self.assertEqual(st.generated_tokens + new_state.generated_tokens, ref.generated_tokens)

    def test_shared_prefix_not_copied_twice(self):
        prefix = list(range(6000, 6000 + 3 * BS))
        a, _ = self.req("a", prefix + [1], new=1)
        b = F.RequestState("b", prefix + [2], max_new_tokens=4)
        F.run(self.bp, self.gpu, b, 1)
        self.bp.offloading_manager.offload(b)  # stores the shared prefix and b's own block
        c = F.RequestState("c", prefix + [3], max_new_tokens=4)
        F.run(self.bp, self.gpu, c, 1)
        self.bp.offloading_manager.offload(c)  # the prefix is already in the pool
        F.finish(self.bp, a)
        f, _ = self.req("f", list(range(9500, 9500 + 11 * BS)), new=1)  # evicts everything cached
        s = self.tier.stats()
        self.assertEqual(s["keys_stored_twice"], 0)
        # The prefix in the pool is not handed to the engine again (or, if it
        # is, the engine reports it already present).
        self.assertGreater(s.get("swap_already_stored", 0) + s.get("store_already-present", 0), 0)
        self.assertEqual(s["store_stored"], s["keys_stored"])

    def test_preempted_blocks_lost_from_the_pool_are_recomputed(self):
        prompt = list(range(4700, 4700 + 2 * BS + 1))
        st = F.RequestState("v", prompt, max_new_tokens=8)
        F.run(self.bp, self.gpu, st, 2)
        new_state = self.bp.offloading_manager.offload(st)
        b, _ = self.req("b", list(range(8000, 8000 + 11 * BS)), new=1)
        F.finish(self.bp, b)
        keys = kvoffload.chain_keys(new_state.initial_tokens, BS, namespace=self.tier.key_namespace)
        self.tier.stats()  # the stores are done
        self.assertEqual(self.tier.engine.delete(keys[1:2]), 1)  # the pool lost v's second block
        before = self.gpu.computed
        F.run(self.bp, self.gpu, new_state, 1)
        s = self.tier.stats()
        self.assertEqual((s.get("resumed", 0), s["resumed_partly"]), (0, 1))
        self.assertEqual(s["resume_recomputed_tokens"], len(new_state.initial_tokens) - 1 - BS)
        self.assertEqual(self.gpu.computed - before, len(new_state.initial_tokens) - BS)
        self.assertEqual(self.gpu.bad, [])

    def test_per_layer_loads(self):
        self.tier.close()
        self.tier = kvt.attach(self.model, engine_factory=F.host_engine_factory(64), check=False, per_layer=True)
        self.addCleanup(self.tier.close)
        self.tier._current_stream = lambda: None  # the host backend has no streams: the CPU waits
        self.manager = self.model.init_continuous_batching()
        self.bp = self.manager._create_batch_processor()
        self.cache = self.bp.cache
        self.gpu = F.FakeGPU(self.tier.engine, self.cache)
        self.assertIn("update", vars(self.cache))
        prefix = list(range(1400, 1400 + 4 * BS))
        a, _ = self.req("a", prefix + [1], new=1)
        F.finish(self.bp, a)
        b, _ = self.req("b", list(range(5000, 5000 + 11 * BS)), new=1)
        F.finish(self.bp, b)
        for reap_first in (False, True):
            st = F.RequestState(f"c{reap_first}", prefix + [3, int(reap_first)], max_new_tokens=1)
            self.bp.scheduler._infer_request_tokens(st, set())
            self.assertEqual(len(self.tier._pending_layers), 1)
            if reap_first:  # the load is done and released before the forward: the stream waits on all of it
                self.tier._reap(wait=True)
                self.assertEqual(self.tier._pending_layers, [])
            for layer in range(2):  # the forward: every layer waits on its copies
                self.cache.update(None, None, layer, None, None)
            self.assertEqual(self.tier._pending_layers, [])
            self.assertTrue(self.gpu.check(st.request_id, self.cache.group_cache_managers[0].block_table[st.request_id],
                                           prefix, len(prefix)))
            F.finish(self.bp, st)
            if not reap_first:
                f, _ = self.req("f", list(range(5000, 5000 + 11 * BS)), new=1)  # evict the prefix again
                F.finish(self.bp, f)

    def test_refused_load_leaves_no_block_behind(self):
        prefix = list(range(1500, 1500 + 4 * BS))
        a, _ = self.req("a", prefix + [1], new=1)
        F.finish(self.bp, a)
        b, _ = self.req("b", list(range(5000, 5000 + 11 * BS)), new=1)
        F.finish(self.bp, b)
        bm = self.cache._block_manager
        free, hashes = bm.num_free_blocks, dict(bm._hash_to_id)
        real_load = self.tier.engine.load

        def busy(*a, **kw):
            raise kvoffload.BusyError("kvoffload: the queue for in-flight room is full")

        self.tier.engine.load = busy
        with self.assertLogs("kvoffload.transformers", "WARNING"):
            st = F.RequestState("c", prefix + [3], max_new_tokens=1)
            toks = self.bp.scheduler._infer_request_tokens(st, set())
        self.tier.engine.load = real_load
        self.assertEqual(toks, prefix + [3])  # everything is computed
        self.assertEqual(self.tier.stats()["load_refused"], 1)
        self.assertEqual(self.tier.engine.stats()["pool"]["blocks_leased"], 0)
        self.assertEqual(bm.num_free_blocks, free)  # the blocks went back (some cached ones were evicted for them)
        self.assertTrue(set(bm._hash_to_id.items()) <= set(hashes.items()))
        computed = F.run(self.bp, self.gpu, st, 1)
        self.assertEqual(self.gpu.bad, [])
        self.assertLessEqual(computed, len(prefix) + 2)

    def test_refused_store_is_not_fatal(self):
        prefix = list(range(1600, 1600 + 4 * BS))
        real_store = self.tier.engine.store

        def full(*a, **kw):
            raise kvoffload.OutOfMemoryError("kvoffload: no room")

        self.tier.engine.store = full
        with self.assertLogs("kvoffload.transformers", "WARNING"):
            # Written behind, or stored as b evicts them: the stores fail.
            a, _ = self.req("a", prefix + [1], new=1)
            F.finish(self.bp, a)
            b, _ = self.req("b", list(range(5000, 5000 + 11 * BS)), new=1)
        self.tier.engine.store = real_store
        self.assertGreater(self.tier.stats()["store_refused"], 0)
        F.finish(self.bp, b)
        c, computed = self.req("c", prefix + [2], new=1)
        self.assertEqual(computed, len(prefix) + 1)  # nothing in kvoffload: computed
        self.assertEqual(self.gpu.bad, [])

    def test_no_room_leaves_the_gpu_prefix(self):
        prefix = list(range(1200, 1200 + 4 * BS))
        a, _ = self.req("a", prefix + [1], new=1)
        F.finish(self.bp, a)
        b, _ = self.req("b", list(range(5000, 5000 + 11 * BS)), new=1)
        F.finish(self.bp, b)
        # Hold every block: the lookup finds the prefix in kvoffload but has no GPU room.
        bm = self.cache._block_manager
        held = bm.get_free_blocks(bm.num_free_blocks, None, True, 0)
        st = F.RequestState("c", prefix + [3], max_new_tokens=1)
        self.assertEqual(self.bp.scheduler._infer_request_tokens(st, set()), prefix + [3])
        self.assertEqual(self.tier.stats()["lookup_deferred"], 1)  # it keeps waiting, holding nothing
        self.assertEqual(st.status, F.RequestStatus.PENDING)
        self.assertNotIn("c", self.cache.group_cache_managers[0].block_table)
        self.assertEqual(self.tier.engine.stats()["pool"]["blocks_leased"], 0)  # the lease was given back
        bm.free_blocks(held, True)
        computed = F.run(self.bp, self.gpu, st, 1)  # scheduled again: now it loads
        self.assertEqual(computed, 1)
        self.assertEqual(self.tier.stats()["kvo_prefix_blocks"], 4)
        self.assertEqual(self.gpu.bad, [])

    def test_partial_room_loads_what_fits(self):
        prefix = list(range(1300, 1300 + 6 * BS))
        a, _ = self.req("a", prefix + [1], new=1)
        F.finish(self.bp, a)
        bm = self.cache._block_manager
        # Evict the tail of a's prefix (last freed first), keep its head on the GPU.
        filler = list(range(7000, 7000 + (len(bm._uninit_block_ids) + 3) * BS - 2))
        f, _ = self.req("f", filler, new=1)
        F.finish(self.bp, f)
        head, h = 0, None
        for b in range(6):
            h = bm.compute_hash(h, prefix[b * BS:(b + 1) * BS], 0)
            if h not in bm._hash_to_id:
                break
            head += 1
        self.assertTrue(0 < head < 5, head)
        # Hold every free block but a's cached head and one more (f's cached blocks go first: last freed).
        held = bm.get_free_blocks(bm.num_free_blocks - head - 1, None, True, 0)
        st = F.RequestState("c", prefix + [3], max_new_tokens=1)
        self.bp.scheduler._infer_request_tokens(st, set())
        s = self.tier.stats()
        self.assertEqual(s["gpu_prefix_blocks"], head)
        self.assertEqual(s["kvo_prefix_blocks"], 1)  # what fits is loaded; the rest is computed
        self.assertEqual(st.position_offset, (head + 1) * BS)
        self.assertEqual(self.tier.engine.stats()["pool"]["blocks_leased"], 0)
        bm.free_blocks(held, True)


if __name__ == "__main__":
    unittest.main()


class HooksWriteBehind(Hooks):
    """The same, with the default write-behind: a block is stored once the
    forward that completes it is queued, so an eviction or a swap copies
    only what is not in the pool yet (a swap's partly filled last block)."""

    WRITE_BEHIND = True

    def assert_evicted_in_pool(self, st, n):
        # In the pool, or its store still in flight (waited on, not copied again).
        self.assertGreaterEqual(st.get("evict_already_stored", 0) + st.get("evict_waited_inflight", 0), n)
        self.assertEqual(st.get("evict_store_blocks", 0), 0, "nothing copied at eviction")
        self.assertEqual(st.get("store_stored", 0), st["behind_store_blocks"])

    def assert_swapped(self, st, full, partial):
        self.assertEqual(st.get("swap_already_stored", 0) + st.get("swap_waited_inflight", 0), full)
        self.assertEqual(st.get("swap_store_blocks", 0), partial)

    def test_blocks_stored_once_complete(self):
        prefix = list(range(3000, 3000 + 3 * BS))
        a, _ = self.req("a", prefix + [1, 2], new=1)
        st = self.tier.stats()
        self.assertEqual(st["behind_store_blocks"], 3)
        self.assertEqual(st["store_stored"], 3)
        keys = kvoffload.chain_keys(prefix, BS, namespace=self.tier.key_namespace)
        self.assertEqual(self.tier.engine.lookup(keys), 3)
        # Shared by a second request on the GPU: not stored again.
        b, _ = self.req("b", prefix + [3, 4], new=1)
        self.assertEqual(self.tier.stats()["behind_store_blocks"], 3)

    def test_missed_lookup_not_repeated_until_a_store_lands(self):
        a = F.RequestState("a", list(range(3500, 3500 + 3 * BS)) + [1], max_new_tokens=2)
        sched = self.bp.scheduler
        for _ in range(5):  # a waiting request, looked up at every scheduling step
            self.cache.search_prefix_match("a", a.remaining_prefill_tokens)
        st = self.tier.stats()
        self.assertEqual(st["lookups"], 5)
        self.assertEqual(st["lookup_misses"], 1)
        self.assertEqual(st["lookups_skipped"], 4)
        # Another request computes and stores the same first block: a is
        # looked up again (and finds it on the GPU, transformers' own match).
        b, _ = self.req("b", list(range(3500, 3500 + BS)) + [7], new=1)
        self.assertIsNotNone(sched)
        got = self.cache.search_prefix_match("a", a.remaining_prefill_tokens)
        self.assertEqual(got, BS)
        self.assertEqual(self.tier.stats()["lookups_skipped"], 4)

    def test_missed_lookup_retried_once_its_key_lands(self):
        prefix = list(range(3700, 3700 + 2 * BS))
        keys = kvoffload.chain_keys(prefix, BS, namespace=self.tier.key_namespace)
        prompt = prefix + [1]  # transformers passes the waiting request's same list at every step
        self.cache.search_prefix_match("w", prompt)
        self.cache.search_prefix_match("w", prompt)
        self.assertEqual(self.tier.stats()["lookups_skipped"], 1)
        # The key lands in the pool (as another process's store would, here
        # stored through the tier's own path): the next lookup asks again.
        self.tier._land(keys[0])
        self.cache.search_prefix_match("w", prompt)
        st = self.tier.stats()
        self.assertEqual(st["lookups_skipped"], 1)
        self.assertEqual(st["lookup_misses"], 2)

    def test_missed_lookup_memo_follows_the_prompt_and_expires(self):
        prefix = list(range(3800, 3800 + 2 * BS))
        first = prefix + [1]
        self.cache.search_prefix_match("r", first)
        self.assertEqual(self.tier.stats()["lookup_misses"], 1)
        # The same request id with another prompt of the same length, whose
        # blocks are in the pool: looked up, not skipped.
        other = list(range(3900, 3900 + 2 * BS)) + [1]
        a, _ = self.req("a", other, new=1)
        F.finish(self.bp, a)
        f, _ = self.req("filler", list(range(8000, 8000 + 11 * BS)), new=1)  # other's blocks leave the GPU
        F.finish(self.bp, f)
        got = self.cache.search_prefix_match("r", list(other))
        self.assertEqual(got, 2 * BS, "found in kvoffload")
        self.assertEqual(self.tier.stats().get("lookups_skipped", 0), 0)
        # A memo is trusted for MISS_RECHECK_S at most.
        self.cache.search_prefix_match("q", first)
        self.cache.search_prefix_match("q", first)
        skipped = self.tier.stats()["lookups_skipped"]
        self.assertEqual(skipped, 1)
        orig, kvt.MISS_RECHECK_S = kvt.MISS_RECHECK_S, 0.0
        try:
            self.cache.search_prefix_match("q", first)
        finally:
            kvt.MISS_RECHECK_S = orig
        self.assertEqual(self.tier.stats()["lookups_skipped"], skipped)

    def test_block_dropped_from_the_pool_is_stored_at_eviction(self):
        prefix = list(range(4100, 4100 + 3 * BS))
        a, _ = self.req("a", prefix + [1], new=1)
        F.finish(self.bp, a)
        keys = kvoffload.chain_keys(prefix, BS, namespace=self.tier.key_namespace)
        self.tier.stats()  # reap: the stores behind the forward landed
        self.tier.engine.delete(keys)  # the pool drops them (its own eviction, a trim, ...)
        b, _ = self.req("b", list(range(8000, 8000 + 11 * BS)), new=1)  # evicts a's blocks
        F.finish(self.bp, b)
        st = self.tier.stats()
        self.assertEqual(st["evict_dropped_from_pool"], 3)
        self.assertEqual(self.tier.engine.lookup(keys), 3, "stored again at eviction")
        c, computed = self.req("c", prefix + [2], new=1)
        self.assertEqual(computed, 1)
        self.assertEqual(self.gpu.bad, [])
