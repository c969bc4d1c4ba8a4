"""The kvoffload tier on transformers' own scheduling code (tf_real: its
requests, BlockManager, FIFOScheduler, OffloadingManager and
PagedAttentionCache's bookkeeping, loaded from a transformers source tree,
without torch), scaled-down versions of bench/transformers_cb.py's
workloads: block size 16 instead of 256, the same shapes. Skipped when no
transformers source is found (tf_real.source_dir)."""

import unittest

from kvoffload.integrations import transformers as kvt

from . import tf_fakes as F
from . import tf_real as R
from .helpers import needs_library

SRC = R.source_dir()
BS = 16


def prefix_workload(requests, prefixes, prefix_len, suffix_len, seed=1):
    import random
    rng = random.Random(seed)
    heads = [[rng.randrange(10, 30000) for _ in range(prefix_len)] for _ in range(prefixes)]
    return [(f"r{i:03d}", heads[i % prefixes] + [rng.randrange(10, 30000) for _ in range(suffix_len)])
            for i in range(requests)]


@needs_library
@unittest.skipUnless(SRC, "no transformers source (install transformers 5.17 or set KVO_TRANSFORMERS_SRC)")
class RealScheduler(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.ns = R.load(SRC)
        kvt.check_signatures({"BlockManager": cls.ns.BlockManager, "PagedAttentionCache": _Sig,
                              "Scheduler": cls.ns.scheduler.Scheduler, "OffloadingManager": cls.ns.OffloadingManager,
                              "ContinuousBatchingManager": F.ContinuousBatchingManager,
                              "ContinuousMixin": F.ContinuousMixin})

    def run_workload(self, work, new_tokens, num_blocks, max_batch_tokens, tier, bs=BS, check_every=1):
        """Runs the requests in order through the loop; returns (loop, tier stats or None)."""
        made = {}

        def make():
            made["bp"] = R.Processor(self.ns, num_blocks, bs, layers=1, max_batch_tokens=max_batch_tokens)
            return made["bp"]

        manager = R.Manager(make)
        t = None
        if tier:
            t = kvt.attach(manager, engine_factory=F.host_engine_factory(512), check=False, model_id="fake")
            self.addCleanup(t.close)
        bp = manager._create_batch_processor()
        if t is not None:
            eng = t.engine
        else:
            eng = F.host_engine_factory(8)(bp.cache, "plain")
            self.addCleanup(eng.close)
        loop = R.Loop(bp, F.FakeGPU(eng, bp.cache, check_every=check_every))
        for rid, toks in work:
            loop.add(rid, toks, new_tokens)
        loop.run()
        self.assertEqual(loop.gpu.bad, [], "a request read KV that computing it would not have written")
        self.assertEqual(loop.misfed, [])
        self.assertEqual(len(loop.outputs), len(work))
        return loop, (t.stats() if t is not None else None)

    def test_prefix_workload(self):
        # 64 requests over 4 interleaved prefixes of 16 blocks, 1 block of their own: the shape.
        work = prefix_workload(64, 4, 16 * BS, BS)
        ideal = 4 * 16 * BS + 64 * BS
        ref, _ = self.run_workload(work, 2, 400, 2 * 17 * BS, tier=False)
        # A cache of 40 blocks (2.5 prefixes): transformers alone recomputes most prefixes (its LIFO
        # eviction drops them between the interleaved requests).
        share, _ = self.run_workload(work, 2, 40, 2 * 17 * BS, tier=False)
        kvo, st = self.run_workload(work, 2, 40, 2 * 17 * BS, tier=True)
        print(f"\nprefix workload (block {BS}): ideal {ideal}, never evicting {ref.prefill_tokens}, "
              f"transformers alone {share.prefill_tokens} ({100 * (share.prefill_tokens / ideal - 1):+.1f}%), "
              f"with kvoffload {kvo.prefill_tokens} ({100 * (kvo.prefill_tokens / ideal - 1):+.1f}%); "
              f"loaded {st.get('kvo_prefix_blocks', 0)} blocks, stored {st.get('store_stored', 0)}; "
              f"batches {share.batches} / {kvo.batches}")
        self.assertGreater(share.prefill_tokens, 1.05 * ideal)  # the problem shows at this scale
        self.assertLessEqual(kvo.prefill_tokens, 1.05 * ideal)
        self.assertEqual(kvo.outputs, ref.outputs)
        self.assertEqual(share.outputs, ref.outputs)
        self.assertEqual(st["keys_stored_twice"], 0)

    def test_preempt_workload(self):
        # 24 requests over 2 prefixes of 4 blocks + 1 of their own, 64 new tokens (4 blocks), 20 blocks.
        work = prefix_workload(24, 2, 4 * BS, BS, seed=2)
        ref, _ = self.run_workload(work, 4 * BS, 400, 8 * BS, tier=False)
        share, _ = self.run_workload(work, 4 * BS, 20, 8 * BS, tier=False)
        kvo, st = self.run_workload(work, 4 * BS, 20, 8 * BS, tier=True)
        print(f"\npreempt workload (block {BS}): preempted {len(share.victims)} requests alone (all recomputed: "
              f"prefill {share.prefill_tokens}), {len(kvo.victims)} with kvoffload: {st.get('swapped_requests', 0)} "
              f"swaps, {st.get('resumed', 0)} resumed with all their KV, {st.get('resumed_partly', 0)} partly "
              f"({st.get('resume_recomputed_tokens', 0)} tokens recomputed), prefill {kvo.prefill_tokens} "
              f"(never evicting {ref.prefill_tokens})")
        self.assertGreater(len(share.victims), 0, "the workload preempts")
        self.assertGreater(st.get("swapped_requests", 0), 0)
        self.assertEqual(kvo.outputs, ref.outputs)
        self.assertEqual(share.outputs, ref.outputs)
        self.assertEqual(st["keys_stored_twice"], 0)
        self.assertEqual(st.get("resumed", 0) + st.get("resumed_partly", 0), st["swapped_requests"])
        self.assertLess(st.get("resumed_partly", 0), st["swapped_requests"])
        self.assertLess(kvo.prefill_tokens, share.prefill_tokens)


class _Sig:
    """PagedAttentionCache's hooked methods, with 5.17's parameters (the
    class itself is not loaded: cache.py needs torch)."""

    def search_prefix_match(self, request_id, prompt_ids):
        pass

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        pass


if __name__ == "__main__":
    unittest.main()
