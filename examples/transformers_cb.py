#!/usr/bin/env python3
"""kvoffload as the prefix and swap tier of transformers' continuous
batching, in five minutes (transformers 5.17, a CUDA GPU).

transformers' continuous batching keeps complete blocks on the GPU after
their request finishes, so that a later request with the same prefix
shares them; when the cache needs room it drops them, and a preempted
request is recomputed (or copied whole into a static pinned pool).
kvoffload.integrations.transformers.attach() adds a host tier underneath:

  - a cached block is stored into kvoffload just before transformers hands
    it to another request (ordered on the compute stream);
  - where transformers' prefix match stops, the rest of the prompt's blocks
    are looked up in kvoffload and loaded instead of recomputed;
  - a preempted request's blocks are stored (a prefix already there is not
    copied again) and loaded back when it is scheduled again.

    PYTHONPATH=python python3 examples/transformers_cb.py              # a random 4-layer Llama, no download
    PYTHONPATH=python python3 examples/transformers_cb.py --model meta-llama/Llama-3.2-1B

Nothing in transformers is changed: attach() installs its hooks on the
model (init_continuous_batching) and on the objects of each batch
processor; tier.close() (or leaving the with block) removes them.
"""

import argparse
import random
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import kvoffload.integrations.transformers as kvt


def random_llama():
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=8192)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    return model.eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model name or path (default: a random 4-layer Llama, nothing downloaded)")
    ap.add_argument("--pool-gib", type=float, default=4.0, help="kvoffload's host pool")
    args = ap.parse_args()

    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, device_map="cuda").eval()
        model_id = args.model  # names the weights in the keys' namespace
    else:
        model = random_llama()
        model_id = f"example-random-llama-{time.time_ns()}"  # random weights: never share their blocks
    model.set_attn_implementation("paged|sdpa")

    # 32 requests over 4 long shared prefixes arriving interleaved (as a server sees them), with a GPU
    # cache of 20 blocks of 256 tokens (2.5 prefixes). generate_batch would sort the prompts, which groups
    # the prefixes; here they are added one by one, in arrival order.
    rng = random.Random(0)
    prefixes = [[rng.randrange(10, 30000) for _ in range(2048)] for _ in range(4)]
    prompts = [prefixes[i % 4] + [rng.randrange(10, 30000) for _ in range(128)] for i in range(32)]
    gen = GenerationConfig(max_new_tokens=16, do_sample=False)
    cbc = ContinuousBatchingConfig(block_size=256, num_blocks=20, max_batch_tokens=4096)

    # attach() checks the transformers version (5.17.x), the model (full attention only) and
    # the config (transformers' own cpu_offload_space must stay 0) before changing anything.
    with kvt.attach(model, pool_bytes=int(args.pool_gib * 2**30), model_id=model_id) as tier:
        t = time.perf_counter()
        out = {}
        with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cbc,
                                                       timeout=30) as manager:
            for i, p in enumerate(prompts):
                manager.add_request(p, request_id=f"req{i}", max_new_tokens=16)
            while len(out) < len(prompts):
                r = manager.get_result(timeout=10)
                if r is None:
                    raise SystemExit("no result for 10 s")
                if r.is_finished():
                    out[r.request_id] = r
        wall = time.perf_counter() - t
        st = tier.stats()

    # On transformers' own scheduling code (python/tests/tf_real.py) this workload computes 5x the
    # prefill tokens it needs without the tier (its cache drops the prefixes between interleaved
    # requests), and each prefix once with it.
    print(f"{len(out)} requests in {wall:.2f} s")
    print(f"prefix blocks shared on the GPU by transformers: {st.get('gpu_prefix_blocks', 0)}")
    print(f"prefix blocks loaded from kvoffload instead of recomputed: {st.get('kvo_prefix_blocks', 0)}")
    print(f"blocks stored before eviction: {st.get('evict_store_blocks', 0)} "
          f"({st.get('store_stored', 0)} copied, {st.get('store_already-present', 0)} already in the pool)")
    print(f"preempted requests stored: {st.get('swapped_requests', 0)}, resumed with all their KV: "
          f"{st.get('resumed', 0)}")
    print(f"per-layer loads: {st['per_layer']}; namespace {st['namespace']}")
    first = next(iter(out.values()))
    print(f"{first.request_id}: {first.generated_tokens}")


if __name__ == "__main__":
    main()
