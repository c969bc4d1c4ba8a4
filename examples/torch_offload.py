"""kvoffload in a PyTorch serving loop (vLLM / SGLang style), in five minutes.

Three places touch the engine:
  1. start-up: create it over the GPU KV cache tensors;
  2. eviction: before the allocator hands an evicted block to another
     request, store it (ordered after the kernels that wrote it, by passing
     the stream), and make the compute stream wait before it overwrites it;
  3. prefill: look the prompt's blocks up, load the hits into free blocks,
     make the compute stream wait, and prefill only the rest.

Run it on a GPU machine:  python examples/torch_offload.py
(build the library first: capi/build.sh; torch with CUDA needed).
"""

import torch

import kvoffload

LAYERS, KV_HEADS, HEAD_DIM, TOKENS_PER_BLOCK, NUM_BLOCKS = 32, 8, 128, 16, 1024


def main():
    # ---- 1. start-up: the stack's own KV cache, one (K, V) pair per layer ----
    kv_caches = [
        (torch.zeros(NUM_BLOCKS, TOKENS_PER_BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
         torch.zeros(NUM_BLOCKS, TOKENS_PER_BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda"))
        for _ in range(LAYERS)
    ]
    engine = kvoffload.Engine.from_tensors(
        kv_caches,
        pool_bytes=4 << 30,  # host pool: exact size, pinned once, kept
        namespace="llama-3-8b/bf16",  # model, dtype: no two models share keys (never the TP rank or size)
        model_kv_heads=KV_HEADS, head_first=0,  # this rank's heads of the model's: every TP size shares the blocks
    )
    compute = torch.cuda.current_stream()

    # A request ran: the model wrote its KV into blocks 0..7 on the compute stream.
    prompt = torch.randint(0, 128000, (8 * TOKENS_PER_BLOCK,)).tolist()
    blocks = list(range(8))
    for k, v in kv_caches:  # stands in for the attention kernels (slices: in place)
        k[0:8].normal_()
        v[0:8].normal_()
    expected = kv_caches[0][0][blocks].clone()

    # ---- 2. eviction: store the request's blocks before reusing them ----
    keys = engine.keys(prompt)  # chained 128-bit keys, same as the Go side
    store = engine.store(keys, blocks, after=compute)  # copies wait for the kernels queued on `compute`
    store.wait_stream(compute)  # `compute` may overwrite blocks 0..7 only after the copies
    store.release()  # outcomes are there if you want them: store.wait() -> ["stored", ...]
    for k, v in kv_caches:  # the blocks are reused by another request
        k[0:8].zero_()
        v[0:8].zero_()

    # ---- 3. prefill of a request with the same prefix ----
    hits, lease = engine.lookup(keys, lease=True)  # longest cached prefix, leased so it cannot be evicted
    free = list(range(100, 100 + hits))  # blocks the allocator gave this request
    if hits:
        with engine.load(keys[:hits], free, lease=lease, after=compute, per_layer=True) as load:
            # Either wait for everything...
            load.wait_stream(compute)
            # ...or let layer i's attention start as soon as layer i is in:
            #   load.wait_layer(i, compute) before running layer i.
            # Prefill the remaining tokens (prompt[hits * TOKENS_PER_BLOCK:]) here, on `compute`.
            assert torch.equal(kv_caches[0][0][free], expected)
    st = engine.stats()
    print(f"prefix hit: {hits} of {len(keys)} blocks loaded; stats: "
          f"{ {'blocks_ready': st['pool']['blocks_ready'], 'hits': st['hits'], 'in_use_bytes': st['pool']['in_use_bytes']} }")
    engine.close()


if __name__ == "__main__":
    main()
