"""The torch part of bench/realmodel.py: the machine, the random Llama
(bench/transformers_cb.py builds its models with random_llama too), its
prefill and decode, CUDA-event timing, and Bench: the engine over a paged
cache, and the host-memory benchmark of one prompt length (run_size).
torch, transformers and kvoffload are imported only when used."""

import os
import random
import subprocess
import sys
import time

from realmodel_report import (HEAD_DIM, HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS, NAMESPACE, PREFETCH_TIMEOUT_S,
                              TPB, VOCAB, assign_block_ids, blocks_for, kv_bytes, make_row, median, paged_slot)


def machine_info():
    import torch
    info = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if drv.returncode == 0 and drv.stdout.strip():
            info["driver"] = drv.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    info["cpus"] = os.cpu_count()
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["memory"] = f"{int(line.split()[1]) / 2**20:.0f} GiB"
    except OSError:
        pass
    return info


def set_attn(model, impl):
    """Switches the attention implementation of a built model (transformers
    5.x reads config._attn_implementation at every forward)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:
        model.config._attn_implementation = impl
    got = getattr(model.config, "_attn_implementation", None)
    if got != impl:
        raise RuntimeError(f"could not switch attention to {impl!r}: config says {got!r} "
                           "(this transformers version has neither set_attn_implementation nor a settable "
                           "config._attn_implementation)")


def random_llama(vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, max_pos, seed):
    """A Llama built from its config in bf16 on the GPU, with random weights
    drawn there whatever the constructor did: normal (std 0.02) matrices,
    norm weights left at 1. Nothing is downloaded. (bench/transformers_cb.py
    builds its models here too.)"""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=max_pos,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.eval()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype != torch.bfloat16 or p.device.type != "cuda":
                raise RuntimeError(f"parameter {name} is {p.dtype} on {p.device}, want bfloat16 on cuda")
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
    return model


def build_model(max_tokens, seed):
    model = random_llama(VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM,
                         max(8192, 2 * max_tokens), seed)
    set_attn(model, "sdpa")
    return model


def layer_kv(cache, i):
    """Layer i's (key, value) of a transformers cache: 5.x DynamicCache
    (cache.layers[i].keys/.values), 4.x (key_cache/value_cache lists), or
    the legacy tuple of tuples."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[i].keys, layers[i].values
    if hasattr(cache, "key_cache"):
        return cache.key_cache[i], cache.value_cache[i]
    if isinstance(cache, (tuple, list)):
        return cache[i][0], cache[i][1]
    raise RuntimeError(f"cannot read layer {i} of a {type(cache).__name__}: neither .layers[i].keys, "
                       ".key_cache nor a tuple")


def build_cache(kv, config):
    """A DynamicCache holding kv (a list of (key, value) [1, heads, seq, dim])."""
    from transformers import DynamicCache
    try:
        cache = DynamicCache(config=config)
    except TypeError:
        cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    n = kv[0][0].shape[2]
    if cache.get_seq_length() != n:
        raise RuntimeError(f"rebuilt DynamicCache says {cache.get_seq_length()} tokens, want {n}")
    return cache


def prefill(model, ids):
    import torch
    with torch.no_grad():
        try:
            return model(input_ids=ids, use_cache=True, logits_to_keep=1)
        except TypeError:  # transformers < 4.50
            return model(input_ids=ids, use_cache=True, num_logits_to_keep=1)


def decode(model, cache, first_token, steps):
    """Greedy decode of steps tokens from cache (which it extends); returns
    the logits of each step."""
    import torch
    out, tok = [], first_token.view(1, 1)
    with torch.no_grad():
        for _ in range(steps):
            o = model(input_ids=tok, past_key_values=cache, use_cache=True)
            logits = o.logits[:, -1].float()
            out.append(logits)
            tok = logits.argmax(-1).view(1, 1)
    return out


def events_ms(start, end):
    end.synchronize()
    return start.elapsed_time(end)


def time_gpu(fn, reps, stream):
    """Times fn on stream with CUDA events reps times: the list of ms."""
    import torch
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(stream)
        fn()
        e.record(stream)
        out.append(events_ms(s, e))
    return out


class Bench:
    """The engine over a paged cache sized for the largest prompt, the
    model, and the pinned buffers of the contiguous references."""

    def __init__(self, args, engine=True):
        import torch

        import kvoffload
        self.torch, self.kvo, self.args = torch, kvoffload, args
        self.rng = random.Random(args.seed)
        nmax = blocks_for(max(args.tokens))
        self.num_blocks = 2 * nmax + 64
        self.model = build_model(max(args.tokens), args.seed)
        self.compute = torch.cuda.current_stream()
        self.kv = [(torch.zeros(self.num_blocks, TPB, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
                    torch.zeros(self.num_blocks, TPB, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda"))
                   for _ in range(LAYERS)]
        # Room for two sizes' blocks: a store after delete never waits for
        # freed slots.
        pool = (2 * nmax + 16) * kv_bytes(TPB)
        t0 = time.perf_counter()
        self.eng = None
        if engine:  # the tier mode opens engines of its own (TierBench)
            self.eng = kvoffload.Engine.from_tensors(self.kv, pool_bytes=pool, first_region_bytes=pool,
                                                     namespace=NAMESPACE, policy="lru")
            # Growth ends at once (one region); the engine then calibrates
            # its copy methods on its growth thread. Waiting for that here
            # keeps the calibration off the model's first prefill, which
            # would otherwise share the GPU with it and could skew the
            # method chosen for the whole process.
            self.eng.wait_grown()
        self.engine_s = time.perf_counter() - t0
        maxb = kv_bytes(max(args.tokens))
        self.host = torch.empty(maxb, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(maxb, dtype=torch.uint8, device="cuda")
        self.checks = []

    def close(self):
        if self.eng is not None:
            self.eng.close()

    def contiguous(self, nbytes):
        """Best ms of a pinned H2D and a D2H copy of nbytes (torch, non_blocking)."""
        h, d = self.host[:nbytes], self.dev[:nbytes]
        d.copy_(h, non_blocking=True)
        h.copy_(d, non_blocking=True)
        h2d = min(time_gpu(lambda: d.copy_(h, non_blocking=True), self.args.reps, self.compute))
        d2h = min(time_gpu(lambda: h.copy_(d, non_blocking=True), self.args.reps, self.compute))
        return h2d, d2h

    def scatter(self, kv, ids):
        """The prefill's KV ([1, heads, n, dim] per layer) into the paged
        cache at block ids (index_copy_ on the compute stream)."""
        idx = self.torch.tensor(ids, device="cuda")
        for (k, v), (pk, pv) in zip(kv, self.kv):
            for src, dst in ((k, pk), (v, pv)):
                dst.index_copy_(0, idx, src[0].transpose(0, 1).reshape(len(ids), TPB, KV_HEADS, HEAD_DIM))

    def gather(self, ids):
        """The paged blocks ids as a list of (key, value) [1, heads, n, dim]."""
        idx = self.torch.tensor(ids, device="cuda")
        n = len(ids) * TPB
        return [tuple(t.index_select(0, idx).reshape(n, KV_HEADS, HEAD_DIM).transpose(0, 1).unsqueeze(0).contiguous()
                      for t in (pk, pv)) for pk, pv in self.kv]

    def bad_blocks(self, ids, ref):
        """Blocks ids of the paged cache that differ from ref (a list of
        paged-layout (K, V) per layer), bit for bit."""
        torch = self.torch
        idx = torch.tensor(ids, device="cuda")
        bad = torch.zeros(len(ids), dtype=torch.bool, device="cuda")
        for (pk, pv), (rk, rv) in zip(self.kv, ref):
            for t, r in ((pk, rk), (pv, rv)):
                bad |= (t.index_select(0, idx).view(torch.int16) != r.view(torch.int16)).view(len(ids), -1).any(1)
        return int(bad.sum())

    def diagnose(self, ids, ref):
        """What the first block of ids that differs from ref holds, in
        words (for a MISMATCH line): its layer-0 K against ref, the poison,
        zeros, and the other blocks' ref (a block loaded into the wrong
        place)."""
        torch = self.torch
        idx = torch.tensor(ids, device="cuda")
        (pk, _), (rk, _) = self.kv[0], ref[0]
        got = pk.index_select(0, idx).view(torch.int16).view(len(ids), -1)
        want = rk.view(torch.int16).view(len(ids), -1)
        diff = (got != want).any(1).nonzero()
        if len(diff) == 0:
            return "layer 0 K of every block matches (the difference is in another layer or V)"
        j = int(diff[0])
        g = got[j]
        same = float((g == want[j]).float().mean())
        poison = float((g == 0x7fc1).float().mean())
        zero = float((g == 0).float().mean())
        other = [i for i in range(len(ids)) if i != j and bool((g == want[i]).all())]
        return (f"block {j} (GPU id {ids[j]}), layer 0 K: {same:.1%} of words as stored, {poison:.1%} poison, "
                f"{zero:.1%} zero, equal to the stored block(s) {other[:4]}")

    def poison(self):
        for pk, pv in self.kv:
            pk.view(self.torch.int16).fill_(0x7fc1)  # a NaN in bf16
            pv.view(self.torch.int16).fill_(0x7fc1)

    def store(self, keys, ids, eng=None, call=None):
        """One store (on eng, default the bench's engine): (GPU ms from
        before the call until the compute stream may reuse the blocks,
        outcomes); call, a list, gets the call's wall ms."""
        torch = self.torch
        eng = self.eng if eng is None else eng
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(self.compute)
        t0 = time.perf_counter()
        op = eng.store(keys, ids, after=self.compute)
        if call is not None:
            call.append((time.perf_counter() - t0) * 1e3)
        op.wait_stream(self.compute)
        e.record(self.compute)
        ms = events_ms(s, e)
        outcomes = op.wait()
        op.release()
        return ms, outcomes

    def load(self, keys, ids, per_layer=False, eng=None, prefetch=False):
        """One load (on eng, default the bench's engine; with prefetch, an
        Engine.prefetch of keys first, inside the timing): (GPU ms from
        before the calls until the compute stream is released, wall ms of
        the calls, per-layer ms or None, outcomes; with prefetch also its
        result). A per-layer load sets self.wait0_ms: wall ms from before
        the calls until wait_layer(0) returned."""
        torch = self.torch
        eng = self.eng if eng is None else eng
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(self.compute)
        t0 = time.perf_counter()
        pre = eng.prefetch(keys, timeout=PREFETCH_TIMEOUT_S) if prefetch else None
        op = eng.load(keys, ids, after=self.compute, per_layer=per_layer)
        call_ms = (time.perf_counter() - t0) * 1e3
        lev = []
        if per_layer:
            for layer in range(LAYERS):
                op.wait_layer(layer, self.compute)
                if layer == 0:
                    self.wait0_ms = (time.perf_counter() - t0) * 1e3
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(self.compute)
                lev.append(ev)
        op.wait_stream(self.compute)
        e.record(self.compute)
        ms = events_ms(s, e)
        layers = [s.elapsed_time(ev) for ev in lev] if per_layer else None
        outcomes = op.wait()
        op.release()
        if prefetch:
            return ms, call_ms, layers, outcomes, pre
        return ms, call_ms, layers, outcomes

    def prepare(self, tokens):
        """A size's prompt, its prefill (the first one timed alone as the
        warm-up, then --reps timed), the KV scattered into the paged cache
        at random block ids (src; dst for loads) and kept as the reference
        in paged layout, and its keys. Returns a dict of those."""
        torch, args = self.torch, self.args
        nb = blocks_for(tokens)
        src, dst = assign_block_ids(self.num_blocks, nb, self.rng)
        gen = torch.Generator(device="cuda").manual_seed(args.seed + tokens)
        ids = torch.randint(0, VOCAB, (1, tokens), device="cuda", generator=gen)
        set_attn(self.model, "sdpa")
        first = {}

        # Recompute: the prefill (the first one is the warm-up).
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = prefill(self.model, ids)
        torch.cuda.synchronize()
        first["prefill_ms"] = (time.perf_counter() - t0) * 1e3
        # Contiguous copies: the reloaded KV is rebuilt contiguous too, so that
        # both decodes run the same kernels on the same layouts.
        orig = [tuple(t.clone(memory_format=torch.contiguous_format) for t in layer_kv(out.past_key_values, i))
                for i in range(LAYERS)]
        first_token = out.logits[0, -1].argmax()
        del out
        if tuple(orig[0][0].shape) != (1, KV_HEADS, tokens, HEAD_DIM):
            raise RuntimeError(f"layer 0 keys are {tuple(orig[0][0].shape)}, want (1, {KV_HEADS}, {tokens}, {HEAD_DIM})")
        prefill_ms = median(time_gpu(lambda: prefill(self.model, ids), args.reps, self.compute))
        torch.cuda.empty_cache()

        # The KV into the paged cache at scattered ids; the reference in paged layout.
        self.poison()
        self.scatter(orig, src)
        ref = [(pk.index_select(0, torch.tensor(src, device="cuda")), pv.index_select(0, torch.tensor(src, device="cuda")))
               for pk, pv in self.kv]
        for t in (0, TPB - 1, TPB, tokens // 2 + 3, tokens - 1):  # the torch paging agrees with paged_slot
            b, o = paged_slot(t, src)
            if not torch.equal(self.kv[5][0][b, o].view(torch.int16), orig[5][0][0, :, t].view(torch.int16)):
                raise RuntimeError(f"token {t}: paged block {b} slot {o} does not hold it")
        keys = self.kvo.chain_keys(ids[0].tolist(), TPB, namespace=NAMESPACE)
        if len(keys) != nb:
            raise RuntimeError(f"{len(keys)} keys for {nb} blocks")
        return {"tokens": tokens, "nb": nb, "src": src, "dst": dst, "orig": orig, "first_token": first_token,
                "prefill_ms": prefill_ms, "first": first, "ref": ref, "keys": keys}

    def decode_check(self, orig, first_token, dst, label):
        """Decodes --decode steps with eager attention from the original KV
        and from the blocks dst of the paged cache; records whether the
        logits are bit-identical."""
        torch, args = self.torch, self.args
        set_attn(self.model, "eager")
        la = decode(self.model, build_cache([(k.clone(), v.clone()) for k, v in orig], self.model.config), first_token,
                    args.decode)
        lb = decode(self.model, build_cache(self.gather(dst), self.model.config), first_token, args.decode)
        same = all(torch.equal(a, b) for a, b in zip(la, lb))
        self.checks.append((same, f"{label}: {args.decode} eager decode steps, logits "
                                  f"{'bit-identical' if same else 'DIFFER'} from the original and the reloaded KV"))
        set_attn(self.model, "sdpa")
        del la, lb
        torch.cuda.empty_cache()

    def run_size(self, tokens):
        torch, args = self.torch, self.args
        p = self.prepare(tokens)
        nb, src, dst, orig, first_token = p["nb"], p["src"], p["dst"], p["orig"], p["first_token"]
        prefill_ms, first, ref, keys = p["prefill_ms"], p["first"], p["ref"], p["keys"]
        del p

        # Warm-up store and load: the first op of this size, checked byte for byte.
        fcall = []
        first["store_ms"], outc = self.store(keys, src, call=fcall)
        first["store_call_ms"] = fcall[0]
        if outc != ["stored"] * nb:
            raise RuntimeError(f"store outcomes: {sorted(set(outc))}")
        self.poison()
        first["load_ms"], _, _, outc = self.load(keys, dst)
        if outc != ["loaded"] * nb:
            raise RuntimeError(f"load outcomes: {sorted(set(outc))}")
        bad = self.bad_blocks(dst, ref)
        self.checks.append((bad == 0, f"{tokens} tokens: {nb - bad} of {nb} blocks byte-exact after store, poison, "
                                      f"load into other block ids"))

        # Decode from the original KV and from the reloaded blocks, eager attention.
        self.decode_check(orig, first_token, dst, f"{tokens} tokens")
        del orig

        # Timed: loads (whole op), per-layer loads, stores.
        reload, calls, layer_runs, totals, stores, store_calls, wait0 = [], [], [], [], [], [], []
        for _ in range(args.reps):
            ms, call, _, outc = self.load(keys, dst)
            reload.append(ms)
            calls.append(call)
        for _ in range(args.reps):
            ms, _, layers, outc = self.load(keys, dst, per_layer=True)
            wait0.append(self.wait0_ms)
            layer_runs.append(layers)
            totals.append(ms)
        bad = self.bad_blocks(dst, ref)
        self.checks.append((bad == 0, f"{tokens} tokens: {nb - bad} of {nb} blocks byte-exact after the timed loads"))
        waits0 = self.eng.stats().get("copies", {}).get("budget_waits", 0)
        for _ in range(args.reps):
            self.eng.delete(keys)
            ms, outc = self.store(keys, src, call=store_calls)
            if outc != ["stored"] * nb:
                raise RuntimeError(f"store outcomes: {sorted(set(outc))}")
            stores.append(ms)
        # A store slower than the link in one process and not the next
        # (seen once, 2.5 ms at every size): did its copies wait for device
        # memory (the log line, for the next such run)?
        print(f"realmodel: {tokens} tokens: the timed stores waited for device memory "
              f"{self.eng.stats().get('copies', {}).get('budget_waits', 0) - waits0} times; store ms {[round(x, 2) for x in stores]}",
              file=sys.stderr)
        self.eng.delete(keys)
        h2d, d2h = self.contiguous(kv_bytes(tokens))
        del ref
        torch.cuda.empty_cache()
        layer_ms = [median([run[l] for run in layer_runs]) for l in range(LAYERS)]
        return make_row(tokens, prefill_ms, median(reload), median(calls), layer_ms, median(totals), median(stores),
                        h2d, d2h, first, store_call_ms=median(store_calls), wait0_ms=median(wait0))
