#!/usr/bin/env python3
"""Reload vs recompute on a real model's KV cache, through kvoffload.

An 8B-class Llama geometry (32 layers, 32 attention heads, 8 KV heads of
128, hidden 4096, intermediate 14336, vocab 32000) is built in transformers
from its config with random bf16 weights on the GPU (nothing is downloaded).
For each prompt length it prefills N random tokens (SDPA attention), copies
the KV cache into a paged layout (per layer a K and a V tensor
[num_blocks, 16, 8, 128], token-major as vLLM keeps it) at random,
non-contiguous block ids, stores those blocks through the engine, poisons
the GPU cache, loads them into other random block ids and checks every
block's bytes against the original KV. It then decodes a few tokens with
eager attention from the original KV and from the reloaded blocks: the
logits must be bit-identical (cuDNN's SDPA is not bit-reproducible, eager
is).

Each size is warmed up once (that first op is reported separately) and
timed over --reps repetitions (medians), against references measured in the
same run: the prefill (recompute), and a contiguous pinned copy of the same
bytes by torch each way (best of --reps). Targets are printed as PASS/FAIL;
only wrong bytes or logits make the exit status nonzero (1).

    make python   # python/kvoffload/libkvoffload.so
    PYTHONPATH=python python3 bench/realmodel.py --out realmodel.md   # and realmodel.svg
    PYTHONPATH=python python3 bench/realmodel.py --tokens 2048 --reps 3
    python3 bench/realmodel.py --selfcheck   # no torch, no GPU: the bookkeeping

The paging and table logic is plain Python (bench/realmodel_report.py) so
that python/tests/test_realmodel_bench.py runs it in CI, where there is no
torch. The torch part (the model, Bench) is bench/realmodel_gpu.py, the tier
mode (--tier) bench/realmodel_tier.py; this file has the command line and
re-exports the names of all three (__all__), as the one module it was.
"""

import argparse
import datetime
import os
import shlex
import sys
import time

# The modules beside this file, however it is run or loaded (python3
# bench/realmodel.py from any directory, a test's load_script, an import).
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from realmodel_report import (CALL_MAX_MS, DEFAULT_TOKENS, DTYPE_BYTES, FILLER_POOLS, FIRST_STORE_MAX, HEAD_DIM,
                              HEADER_BYTES, HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYER_SLACK_MS, LAYERS, NAMESPACE,
                              PREFETCH_TIMEOUT_S, RELOAD_LONG_MIN, RELOAD_LONG_TOKENS, RELOAD_MIN, STORE_MIN,
                              TABLE_HEADER, TIER_KINDS, TIER_METHOD, TIER_POOL_SLACK, TPB, VOCAB, WAIT0_MAX_MS,
                              _esc, assign_block_ids, blocks_for, format_first, format_report, format_svg, format_table,
                              format_targets, format_tier_report, format_tier_table, from_paged, fs_type, kv_bytes,
                              layer_verdicts, make_row, make_tier_row, median, paged_slot, parse_tier, ratio, selfcheck,
                              svg_path, targets, tier_label, tier_out_path, tier_selfcheck, to_paged)
from realmodel_gpu import (Bench, build_cache, build_model, decode, events_ms, layer_kv, machine_info, prefill,
                           random_llama, set_attn, time_gpu)
from realmodel_tier import TierBench, run_tiers

__all__ = [
    "TPB", "LAYERS", "HEADS", "KV_HEADS", "HEAD_DIM", "HIDDEN", "INTERMEDIATE", "VOCAB", "DTYPE_BYTES",
    "DEFAULT_TOKENS", "NAMESPACE", "RELOAD_MIN", "RELOAD_LONG_MIN", "RELOAD_LONG_TOKENS", "STORE_MIN", "LAYER_SLACK_MS",
    "CALL_MAX_MS", "WAIT0_MAX_MS", "FIRST_STORE_MAX", "blocks_for", "kv_bytes", "assign_block_ids", "paged_slot",
    "to_paged", "from_paged", "median", "ratio", "layer_verdicts", "targets", "make_row", "TABLE_HEADER",
    "format_table", "format_first", "format_targets", "format_report", "_esc", "svg_path", "format_svg", "TIER_KINDS",
    "PREFETCH_TIMEOUT_S", "TIER_POOL_SLACK", "FILLER_POOLS", "HEADER_BYTES", "parse_tier", "fs_type", "tier_label",
    "make_tier_row", "format_tier_table", "TIER_METHOD", "format_tier_report", "tier_out_path", "tier_selfcheck",
    "selfcheck", "machine_info", "set_attn", "random_llama", "build_model", "layer_kv", "build_cache", "prefill",
    "decode", "events_ms", "time_gpu", "Bench", "TierBench", "run_tiers"
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS),
                    help="prompt lengths, multiples of 16 (default: 2048 8192 32768)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement (default 5)")
    ap.add_argument("--decode", type=int, default=4, help="eager decode steps compared (default 4)")
    ap.add_argument("--seed", type=int, default=1, help="seed of weights, prompts and block ids")
    ap.add_argument("--out", help="also write the results (markdown) to this file, and beside it an SVG plot "
                    "of reload and recompute time by prompt length (realmodel.md: realmodel.svg)")
    ap.add_argument("--tier", action="append", default=[], metavar="disk:DIR|cluster:HOST:PORT[,...]",
                    help="instead of the host-memory benchmark: reload the KV from the disk tier (records in a new "
                    "folder under DIR) or from the Redis Cluster at HOST:PORT, beside reload from host memory and "
                    "recompute; one table per tier (--out X.md: X-disk.md, X-cluster.md). Repeatable, once per kind")
    ap.add_argument("--selfcheck", action="store_true", help="check the paging and table logic without torch; exit")
    args = ap.parse_args(argv)
    if args.selfcheck:
        selfcheck()
        print("realmodel selfcheck: ok")
        return 0
    try:
        tiers = [parse_tier(t) for t in args.tier]
    except ValueError as e:
        ap.error(str(e))
    kinds = [k for k, _ in tiers]
    if len(set(kinds)) != len(kinds):
        ap.error(f"--tier: each kind at most once, got {', '.join(args.tier)}")
    for t in args.tokens:
        blocks_for(t)
    if args.reps < 1 or args.decode < 1:
        ap.error("--reps and --decode must be at least 1")
    try:
        import torch
    except ImportError:
        print("realmodel: needs torch with CUDA (and transformers); --selfcheck runs without", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("realmodel: no CUDA device", file=sys.stderr)
        return 2
    command = "python3 bench/realmodel.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    if tiers:
        return run_tiers(args, tiers, command.strip(), started)
    t0 = time.perf_counter()
    b = Bench(args)
    print(f"realmodel: model and engine ready in {time.perf_counter() - t0:.1f} s "
          f"(engine {b.engine_s:.2f} s, {b.num_blocks} GPU blocks per layer)", file=sys.stderr)
    rows = []
    try:
        for tokens in args.tokens:
            t1 = time.perf_counter()
            rows.append(b.run_size(tokens))
            print(f"realmodel: {tokens} tokens done in {time.perf_counter() - t1:.1f} s", file=sys.stderr)
        # How the engine chose its copies in this process (the method is
        # calibrated once per process): a store slower than the link in one
        # run and not the next may be a different choice.
        st = b.eng.stats()
        engine_facts = {"copy calibration": st.get("copies", {}).get("calibration", "") or "none",
                        "bounce copies": st.get("copies", {}).get("bounced", 0),
                        "pitched copies": st.get("copies", {}).get("pitched", 0),
                        "copy budget waits": st.get("copies", {}).get("budget_waits", 0)}
    finally:
        b.close()
    machine = machine_info()
    machine.update(engine_facts if rows else {})
    report = format_report(command.strip(), machine, rows, b.checks, args.reps, started)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
        with open(svg_path(args.out), "w") as f:
            f.write(format_svg(rows))
        print(f"realmodel: wrote {args.out} and {svg_path(args.out)}", file=sys.stderr)
    ok = all(ok for ok, _ in b.checks)
    if not ok:
        print("realmodel: MISMATCH: bytes or logits differ (see Checks)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
