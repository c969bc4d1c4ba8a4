"""The plain-Python part of bench/realmodel.py: its geometry and targets,
block ids, paging, the results (rows, targets, tables, the SVG plot), the
tier mode's arguments and tables, and selfcheck. No torch and no GPU:
python/tests/test_realmodel_bench.py runs it in CI (through realmodel.py,
which re-exports every name here)."""

import os
import random
import statistics

TPB = 16  # tokens per block
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 32, 32, 8, 128
HIDDEN, INTERMEDIATE, VOCAB = 4096, 14336, 32000
DTYPE_BYTES = 2  # bf16
DEFAULT_TOKENS = (2048, 8192, 32768)
NAMESPACE = "realmodel/llama-8b-geometry/bf16"

# Targets (issues 21 and 51): reload at >= 92% of a contiguous pinned H2D copy
# of the same bytes (95% from RELOAD_LONG_TOKENS tokens), store at >= 92% of a
# contiguous D2H copy, per-layer events no later than their share of the
# same-run contiguous H2D copy plus 0.75 ms, store() and load() back within
# 1.5 ms, wait_layer(0) back within 1 ms of the load() call, and the first
# store (the warm-up) within 1.2x the timed ones.
RELOAD_MIN = 0.92
RELOAD_LONG_MIN = 0.95
RELOAD_LONG_TOKENS = 8192
STORE_MIN = 0.92
LAYER_SLACK_MS = 0.75
CALL_MAX_MS = 1.5
WAIT0_MAX_MS = 1.0
FIRST_STORE_MAX = 1.2


# ---- plain Python: block ids, paging, results --------------------------------

def blocks_for(tokens, tpb=TPB):
    """Full blocks of a prompt of tokens (the benchmark uses multiples of tpb)."""
    if tokens <= 0 or tokens % tpb:
        raise ValueError(f"tokens = {tokens}: must be a positive multiple of {tpb}")
    return tokens // tpb


def kv_bytes(tokens, layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype_bytes=DTYPE_BYTES):
    """Bytes of K and V for tokens over all layers."""
    return 2 * layers * tokens * kv_heads * head_dim * dtype_bytes


def assign_block_ids(num_blocks, n, rng):
    """Two disjoint lists of n GPU block ids in random order out of
    num_blocks, as an allocator hands them out after churn: the blocks the
    prefill wrote (stored from) and the blocks a later request got (loaded
    into)."""
    if 2 * n > num_blocks:
        raise ValueError(f"{2 * n} distinct blocks asked for, the cache has {num_blocks}")
    ids = rng.sample(range(num_blocks), 2 * n)
    return ids[:n], ids[n:]


def paged_slot(token, ids, tpb=TPB):
    """Where token lives in the paged cache: (block id, offset in the block)."""
    return ids[token // tpb], token % tpb


def to_paged(seq, ids, num_blocks, tpb=TPB, fill=None):
    """A sequence of per-token items (one per token) written into a paged
    cache of num_blocks blocks of tpb slots at block ids: what the torch
    code does with index_copy_ on [num_blocks, tpb, heads, dim]."""
    if len(seq) != len(ids) * tpb:
        raise ValueError(f"{len(seq)} tokens do not fill {len(ids)} blocks of {tpb}")
    paged = [[fill] * tpb for _ in range(num_blocks)]
    for t, item in enumerate(seq):
        b, o = paged_slot(t, ids, tpb)
        paged[b][o] = item
    return paged


def from_paged(paged, ids, tpb=TPB):
    """The sequence held by blocks ids of a paged cache, in token order."""
    return [paged[b][o] for b in ids for o in range(tpb)]


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def ratio(num, den):
    return num / den if den else float("nan")


def layer_verdicts(layer_ms, total_ms, slack_ms=LAYER_SLACK_MS):
    """Layers whose event came later than (l+1)*total/L + slack (total: the
    contiguous H2D copy of the whole KV): a list of (layer, ms, bound) for
    the late ones (empty: PASS)."""
    n = len(layer_ms)
    late = []
    for l, ms in enumerate(layer_ms):
        bound = (l + 1) * total_ms / n + slack_ms
        if ms > bound:
            late.append((l, ms, bound))
    return late


def targets(row):
    """The PASS/FAIL lines of one size's row (see make_row), in this order:
    reload, store, per-layer, call times, wait_layer(0), first store. A
    value not measured (nan) fails."""
    out = []
    t = row["tokens"]
    fr = row["floor_over_reload"]
    rmin = RELOAD_LONG_MIN if t >= RELOAD_LONG_TOKENS else RELOAD_MIN
    out.append((fr >= rmin, f"{t} tokens: reload {row['reload_ms']:.2f} ms, contiguous H2D "
                f"{row['h2d_ms']:.2f} ms: {100 * fr:.1f}% of the floor [>= {100 * rmin:.0f}%]"))
    sr = row["d2h_over_store"]
    out.append((sr >= STORE_MIN, f"{t} tokens: store {row['store_ms']:.2f} ms, contiguous D2H "
                f"{row['d2h_ms']:.2f} ms: {100 * sr:.1f}% of the floor [>= {100 * STORE_MIN:.0f}%]"))
    late = layer_verdicts(row["layer_ms"], row["h2d_ms"])
    if row["h2d_ms"] != row["h2d_ms"]:
        late = [(0, row["layer_ms"][0], float("nan"))]
    if late:
        l, ms, bound = late[0]
        text = (f"{t} tokens: per-layer load: {len(late)} of {len(row['layer_ms'])} layers late, "
                f"first layer {l} at {ms:.2f} ms > {bound:.2f} ms [(l+1)*C/L + {LAYER_SLACK_MS:g} ms, "
                f"C the contiguous H2D copy]")
    else:
        text = (f"{t} tokens: per-layer load: every layer l by (l+1)*C/L + {LAYER_SLACK_MS:g} ms, C the contiguous "
                f"H2D copy (layer 0 at {row['layer_ms'][0]:.2f} ms, all at {row['layer_total_ms']:.2f} ms)")
    out.append((not late, text))
    lc, sc = row["load_return_ms"], row["store_call_ms"]
    out.append((lc <= CALL_MAX_MS and sc <= CALL_MAX_MS,
                f"{t} tokens: load() returned after {lc:.3f} ms, store() after {sc:.3f} ms [<= {CALL_MAX_MS:g} ms]"))
    w0 = row["wait0_ms"]
    out.append((w0 <= WAIT0_MAX_MS, f"{t} tokens: wait_layer(0) returned {w0:.3f} ms after the per-layer load() "
                f"was called [<= {WAIT0_MAX_MS:g} ms]"))
    fs = row["first"].get("store_ms", float("nan"))
    out.append((fs <= FIRST_STORE_MAX * row["store_ms"],
                f"{t} tokens: first store {fs:.2f} ms, {ratio(fs, row['store_ms']):.2f}x the timed stores' "
                f"{row['store_ms']:.2f} ms [<= {FIRST_STORE_MAX:g}x]"))
    return out


def make_row(tokens, prefill_ms, reload_ms, load_return_ms, layer_ms, layer_total_ms, store_ms, h2d_ms, d2h_ms,
             first=None, store_call_ms=float("nan"), wait0_ms=float("nan")):
    """One size's results: medians of the timed reps (layer_ms: the median
    per layer; load_return_ms, store_call_ms: the calls' wall clock;
    wait0_ms: from the per-layer load() call until wait_layer(0) returned),
    best-of references, and the warm-up's times in first."""
    return {
        "store_call_ms": store_call_ms,
        "wait0_ms": wait0_ms,
        "tokens": tokens,
        "kv_gb": kv_bytes(tokens) / 1e9,
        "prefill_ms": prefill_ms,
        "reload_ms": reload_ms,
        "h2d_ms": h2d_ms,
        "floor_over_reload": ratio(h2d_ms, reload_ms),
        "load_return_ms": load_return_ms,
        "layer_ms": list(layer_ms),
        "layer_total_ms": layer_total_ms,
        "store_ms": store_ms,
        "d2h_ms": d2h_ms,
        "d2h_over_store": ratio(d2h_ms, store_ms),
        "recompute_over_reload": ratio(prefill_ms, reload_ms),
        "first": first or {},
    }


TABLE_HEADER = (
    "| tokens | KV GB | recompute (prefill ms) | reload ms | contiguous H2D ms | floor/reload "
    "| load() returned after ms | wait_layer(0) returned after ms | per-layer load: layer 0 / all ms | store ms "
    "| store() returned after ms | contiguous D2H ms | D2H/store | recompute/reload |\n"
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")


def format_table(rows):
    lines = [TABLE_HEADER]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['kv_gb']:.2f} | {r['prefill_ms']:.1f} | {r['reload_ms']:.2f} | {r['h2d_ms']:.2f} "
            f"| {r['floor_over_reload']:.2f} | {r['load_return_ms']:.3f} | {r['wait0_ms']:.3f} | {r['layer_ms'][0]:.2f} / "
            f"{r['layer_total_ms']:.2f} | {r['store_ms']:.2f} | {r['store_call_ms']:.3f} | {r['d2h_ms']:.2f} "
            f"| {r['d2h_over_store']:.2f} | {r['recompute_over_reload']:.1f}x |\n")
    return "".join(lines)


def format_first(rows):
    """The warm-up (first) op of each size, for warm start."""
    lines = ["| tokens | first store ms | first store() returned after ms | first load ms | first prefill ms |\n"
             "|---:|---:|---:|---:|---:|\n"]
    for r in rows:
        f = r["first"]
        lines.append(f"| {r['tokens']} | {f.get('store_ms', float('nan')):.2f} "
                     f"| {f.get('store_call_ms', float('nan')):.3f} | {f.get('load_ms', float('nan')):.2f} "
                     f"| {f.get('prefill_ms', float('nan')):.1f} |\n")
    return "".join(lines)


def format_targets(rows):
    return "".join(f"- {'PASS' if ok else 'FAIL'}: {text}\n" for r in rows for ok, text in targets(r))


def format_report(command, machine, rows, checks, reps, started):
    """The results file: command, date, machine, then the tables."""
    out = [
        "# kvoffload: reload vs recompute on an 8B-class Llama's KV cache\n\n",
        f"Command: `{command}`  \nDate: {started}  \n",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()) + "\n\n",
        f"Llama geometry, random bf16 weights: {LAYERS} layers, {HEADS} heads, {KV_HEADS} KV heads of {HEAD_DIM}, "
        f"hidden {HIDDEN}, intermediate {INTERMEDIATE}, vocab {VOCAB}; {TPB}-token blocks "
        f"({kv_bytes(TPB) >> 20} MiB per block over all layers) at random GPU block ids. "
        f"Median of {reps} timed reps after one warm-up; contiguous copies: best of {reps}. "
        "reload: CUDA events on the compute stream, from just before load() to after the stream waited on the op. "
        "load() and store() returned after: wall clock of the call. wait_layer(0) returned after: wall clock from "
        "the per-layer load() call until wait_layer(0) returned. Per-layer: a per_layer load, the compute stream "
        "waiting on each layer's event in turn and recording its own event after each. The engine's copy calibration "
        "ran (wait_grown) before the model did.\n\n",
        format_table(rows), "\n## First op (warm-up) per size\n\n", format_first(rows),
        "\n## Targets\n\n", format_targets(rows), "\n## Checks\n\n",
        "".join(f"- {'ok' if ok else 'MISMATCH'}: {text}\n" for ok, text in checks),
    ]
    return "".join(out)


def _esc(text):
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def svg_path(out):
    """The plot's file beside the --out report: realmodel.md -> realmodel.svg."""
    return os.path.splitext(out)[0] + ".svg"


def format_svg(rows, title="kvoffload: reload vs recompute, 8B-class Llama KV cache"):
    """An SVG plot (hand-written text, no library) of reload and recompute
    (prefill) time against prompt length, with the contiguous H2D copy of
    the same bytes dashed: log2 tokens across, log10 ms up."""
    import math
    series = [("recompute (prefill)", "prefill_ms", "#d62728", ""),
              ("reload (kvoffload load)", "reload_ms", "#1f77b4", ""),
              ("contiguous H2D copy", "h2d_ms", "#7f7f7f", "6,4")]
    pts = [(r["tokens"], r[key]) for r in rows for _, key, _, _ in series
           if r["tokens"] > 0 and isinstance(r.get(key), (int, float)) and r[key] > 0 and math.isfinite(r[key])]
    w, h, left, right, top, bottom = 720, 440, 70, 200, 40, 55
    pw, ph = w - left - right, h - top - bottom
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
           'font-family="sans-serif" font-size="12">\n',
           f'<rect width="{w}" height="{h}" fill="white"/>\n',
           f'<text x="{left + pw / 2:.1f}" y="22" text-anchor="middle" font-size="14">{_esc(title)}</text>\n']
    if not pts:
        out.append(f'<text x="{w / 2:.1f}" y="{h / 2:.1f}" text-anchor="middle">no results</text>\n</svg>\n')
        return "".join(out)
    xs = [math.log2(t) for t, _ in pts]
    x0, x1 = min(xs), max(xs)
    if x1 - x0 < 1e-9:
        x0, x1 = x0 - 1, x1 + 1
    y0 = math.floor(math.log10(min(v for _, v in pts)))
    y1 = math.ceil(math.log10(max(v for _, v in pts)))
    if y1 <= y0:
        y1 = y0 + 1

    def px(tokens):
        return left + (math.log2(tokens) - x0) / (x1 - x0) * pw

    def py(ms):
        return top + ph - (math.log10(ms) - y0) / (y1 - y0) * ph

    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="black"/>\n')
    for d in range(y0, y1 + 1):
        y = py(10 ** d)
        label = f"{10 ** d:g}"
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#ddd"/>'
                   f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{label}</text>\n')
    for t in sorted({r["tokens"] for r in rows if r["tokens"] > 0}):
        x = px(t)
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" stroke="#eee"/>'
                   f'<text x="{x:.1f}" y="{top + ph + 18}" text-anchor="middle">{t}</text>\n')
    out.append(f'<text x="{left + pw / 2:.1f}" y="{h - 12}" text-anchor="middle">prompt length (tokens, log scale)</text>\n')
    out.append(f'<text transform="translate(18 {top + ph / 2:.1f}) rotate(-90)" text-anchor="middle">'
               'time (ms, log scale)</text>\n')
    for i, (name, key, color, dash) in enumerate(series):
        line = [(px(r["tokens"]), py(r[key])) for r in sorted(rows, key=lambda r: r["tokens"])
                if r["tokens"] > 0 and isinstance(r.get(key), (int, float)) and r[key] > 0 and math.isfinite(r[key])]
        if line:
            dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
            points = " ".join(f"{x:.1f},{y:.1f}" for x, y in line)
            out.append(f'<polyline class="series" data-series="{key}" fill="none" stroke="{color}" stroke-width="2"'
                       f'{dash_attr} points="{points}"/>\n')
            for x, y in line:
                out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>\n')
        ly = top + 10 + i * 20
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<line x1="{left + pw + 12}" y1="{ly}" x2="{left + pw + 36}" y2="{ly}" stroke="{color}" '
                   f'stroke-width="2"{dash_attr}/><text x="{left + pw + 42}" y="{ly + 4}">{_esc(name)}</text>\n')
    out.append("</svg>\n")
    return "".join(out)


# ---- plain Python: the lower tiers (--tier) -----------------------------------

TIER_KINDS = ("disk", "cluster")
PREFETCH_TIMEOUT_S = 60.0  # the cluster tier's wait in Engine.prefetch (and its per-write timeout)
TIER_POOL_SLACK = 16  # host pool of a tier run: the prompt's blocks and this many more
# Fillers stored to push the KV out of a disk run's host pool: this many
# pools' worth (one is not always enough: the policy may keep an older block
# and evict a newer one).
FILLER_POOLS = 2
HEADER_BYTES = 4096  # a record's header sector (internal/tier/record)


def parse_tier(spec):
    """--tier disk:DIR or cluster:HOST:PORT[,HOST:PORT...] as (kind, arg):
    arg the directory, or the list of seed nodes. ValueError otherwise."""
    kind, sep, rest = spec.partition(":")
    if not sep or kind not in TIER_KINDS or not rest:
        raise ValueError(f"--tier {spec!r}: want disk:DIR or cluster:HOST:PORT[,HOST:PORT...]")
    if kind == "disk":
        return kind, rest
    addrs = rest.split(",")
    for a in addrs:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--tier {spec!r}: {a!r} is not HOST:PORT with a port from 1 to 65535")
    return kind, addrs


def fs_type(path, mounts):
    """The file system type and mount point holding path, from the text
    of /proc/mounts (the longest mount point that is a prefix of path):
    (type, mount point), or ("?", "?")."""
    best = ("?", "?")
    for line in mounts.splitlines():
        f = line.split()
        if len(f) < 3:
            continue
        mnt = f[1].replace("\\040", " ")
        if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and (best[1] == "?" or len(mnt) >= len(best[1])):
            best = (f[2], mnt)
    return best


def tier_label(kind):
    return {"disk": "disk", "cluster": "the cluster"}[kind]


def make_tier_row(tokens, prefill_ms, host_ms, tier_first_ms, tier_ms, tier_call_ms, write_s, engine_open_s):
    """One size's results for a tier: the prefill (recompute), reload from
    host memory, reload from the tier (first: in an engine just opened on
    the tier, then the median of the timed reps), the calls' wall time,
    the seconds the writing engine took to get the KV onto the tier and the
    reading engine's start."""
    gb = kv_bytes(tokens) / 1e9
    return {"tokens": tokens, "kv_gb": gb, "prefill_ms": prefill_ms, "host_ms": host_ms, "tier_first_ms": tier_first_ms,
            "tier_ms": tier_ms, "tier_call_ms": tier_call_ms, "tier_gbs": ratio(gb, tier_ms / 1e3),
            "recompute_over_tier": ratio(prefill_ms, tier_ms), "write_s": write_s, "engine_open_s": engine_open_s}


def format_tier_table(kind, rows):
    t = tier_label(kind)
    lines = [f"| tokens | KV GB | recompute (prefill ms) | reload from host ms | reload from {t} ms "
             f"| {t} GB/s | first reload from {t} ms (new engine) | prefetch+load calls returned after ms "
             f"| recompute / reload from {t} | writer: store to closed s | reading engine opened in s |\n",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['kv_gb']:.2f} | {r['prefill_ms']:.1f} | {r['host_ms']:.2f} | {r['tier_ms']:.2f} "
                     f"| {r['tier_gbs']:.2f} | {r['tier_first_ms']:.2f} | {r['tier_call_ms']:.2f} "
                     f"| {r['recompute_over_tier']:.2f}x | {r['write_s']:.2f} | {r['engine_open_s']:.2f} |\n")
    return "".join(lines)


TIER_METHOD = {
    "disk": ("An engine (A) with the disk tier on {where} (`admit_all`) stores the KV from the GPU, then {pools} "
             "times as many other blocks as its host pool holds (the prompt's blocks + {slack}), so that the policy "
             "evicts the KV and A writes it back to disk (and the fillers it evicts too: `writer: store to closed` "
             "counts them); A closes (its queued write-backs finish). A second engine (B) opens "
             "on the same directory, as a restarted server would, and rebuilds its index from the record headers. "
             "Reload from disk: B's `load()` of keys only the disk holds (Load promotes them through host slots; "
             "no prefetch call), from just before the call until the compute stream may run (CUDA events). "
             "Before each timed rep B stores fresh other blocks, {pools} pools' worth, to push the KV out of its pool "
             "again (blocks already on disk are not written again; the others are seen once and not admitted). "
             "Reload from host: B's `load()` right after, the blocks now in its pool."),
    "cluster": ("A Redis Cluster on {where}. An engine (A) with the cluster tier stores the KV from the GPU; every "
                "stored block is written through to the cluster asynchronously, and A waits until the cluster "
                "acknowledged every one, then closes. A second engine (B), with an empty pool, is a server on "
                "another machine, or restarted: reload from the cluster is B's `prefetch()` (which promotes the "
                "blocks into host slots; timeout {timeout:g} s) then `load()`, from just before the prefetch until "
                "the compute stream may run (CUDA events). Before each timed rep B deletes the keys from its pool "
                "(Delete does not reach the cluster). Reload from host: B's `load()` right after."),
}


def format_tier_report(command, machine, kind, where, rows, checks, reps, started, notes=()):
    """The results file of one tier: command, date, machine, the method,
    the table, notes (file system, stats) and the checks."""
    t = tier_label(kind)
    out = [f"# kvoffload: reload from {t} vs from host memory vs recompute, 8B-class Llama KV cache\n\n",
           f"Command: `{command}`  \nDate: {started}  \n",
           "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()) + "\n\n",
           f"Llama geometry, random bf16 weights: {LAYERS} layers, {KV_HEADS} KV heads of {HEAD_DIM}; {TPB}-token blocks "
           f"({kv_bytes(TPB) >> 20} MiB per block, a record of {(kv_bytes(TPB) + HEADER_BYTES) / 2**20:.2f} MiB with its "
           f"header) at random GPU block ids. Median of {reps} timed reps after the first reload. ",
           TIER_METHOD[kind].format(where=where, slack=TIER_POOL_SLACK, pools=FILLER_POOLS, timeout=PREFETCH_TIMEOUT_S), "\n\n",
           format_tier_table(kind, rows)]
    if notes:
        out += ["\n## Notes\n\n"] + [f"- {n}\n" for n in notes]
    out += ["\n## Checks\n\n", "".join(f"- {'ok' if ok else 'MISMATCH'}: {text}\n" for ok, text in checks)]
    return "".join(out)


def tier_out_path(out, kind):
    """--out realmodel.md with --tier: realmodel-disk.md, realmodel-cluster.md."""
    base, ext = os.path.splitext(out)
    return f"{base}-{kind}{ext or '.md'}"


def tier_selfcheck():
    """The tier mode's plain-Python part (selfcheck calls it)."""
    assert parse_tier("disk:/var/tmp/x") == ("disk", "/var/tmp/x")
    assert parse_tier("cluster:127.0.0.1:7000") == ("cluster", ["127.0.0.1:7000"])
    assert parse_tier("cluster:a:1,b:65535") == ("cluster", ["a:1", "b:65535"])
    for bad in ("disk", "disk:", "tape:/x", "cluster:host", "cluster:host:0", "cluster:host:65536", "cluster::7000",
                "cluster:h:70x", "cluster:a:1,", ""):
        try:
            parse_tier(bad)
        except ValueError as e:
            assert repr(bad) in str(e), (bad, str(e))
        else:
            raise AssertionError(f"parse_tier({bad!r}) accepted")
    mounts = ("overlay / overlay rw 0 0\n/dev/nvme0n1p1 /data ext4 rw 0 0\ntmpfs /tmp tmpfs rw 0 0\n"
              "/dev/sdb1 /data/x\\040y xfs rw 0 0\n")
    assert fs_type("/data/kvo", mounts) == ("ext4", "/data")
    assert fs_type("/database", mounts) == ("overlay", "/")
    assert fs_type("/tmp", mounts) == ("tmpfs", "/tmp")
    assert fs_type("/data/x y/z", mounts) == ("xfs", "/data/x y")
    assert fs_type("/x", "") == ("?", "?")
    assert tier_out_path("r/realmodel.md", "disk") == "r/realmodel-disk.md"
    assert tier_out_path("tiers", "cluster") == "tiers-cluster.md"
    row = make_tier_row(8192, prefill_ms=420.0, host_ms=20.5, tier_first_ms=700.0, tier_ms=512.0, tier_call_ms=498.0,
                        write_s=1.5, engine_open_s=0.25)
    assert abs(row["tier_gbs"] - kv_bytes(8192) / 1e9 / 0.512) < 1e-9 and abs(row["recompute_over_tier"] - 420 / 512) < 1e-12
    md = format_tier_report("python3 bench/realmodel.py --tier disk:/d", {"gpu": "none"}, "disk", "/d (ext4, O_DIRECT)",
                            [row], [(True, "8192 tokens: ok"), (False, "8192 tokens: bad")], 3, "2026-01-01T00:00:00Z",
                            notes=["a note"])
    for want in ("| 8192 | 1.07 | 420.0 | 20.50 | 512.00 | 2.10 | 700.00 | 498.00 | 0.82x | 1.50 | 0.25 |",
                 "reload from disk ms", "/d (ext4, O_DIRECT)", "- a note", "- ok: 8192 tokens: ok",
                 "- MISMATCH: 8192 tokens: bad", "Median of 3 timed reps"):
        assert want in md, (want, md)
    md = format_tier_report("c", {}, "cluster", "127.0.0.1:7000", [row], [], 3, "d")
    assert "reload from the cluster ms" in md and "prefetch()" in md and "## Notes" not in md
    return md


def selfcheck():
    """The plain-Python part, without torch or a GPU. Raises AssertionError."""
    assert blocks_for(2048) == 128 and blocks_for(32768) == 2048
    for bad in (0, 15, 2047):
        try:
            blocks_for(bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"blocks_for({bad}) accepted")
    assert kv_bytes(16) == 2 << 20, "one 16-token block of the 8B geometry is 2 MiB"
    assert kv_bytes(8192) == 1 << 30

    rng = random.Random(7)
    num_blocks, n = 300, 128
    src, dst = assign_block_ids(num_blocks, n, rng)
    assert len(src) == len(dst) == n
    assert not set(src) & set(dst), "store and load ids overlap"
    assert len(set(src)) == n and all(0 <= b < num_blocks for b in src + dst)
    assert src != sorted(src), "ids should be scattered, not handed out in order"
    try:
        assign_block_ids(10, 6, rng)
    except ValueError:
        pass
    else:
        raise AssertionError("assign_block_ids gave 12 distinct ids out of 10")

    seq = [("tok", t) for t in range(n * TPB)]
    paged = to_paged(seq, src, num_blocks)
    assert from_paged(paged, src) == seq
    for t in (0, 15, 16, 1000, n * TPB - 1):
        b, o = paged_slot(t, src)
        assert paged[b][o] == seq[t] and b == src[t // TPB] and o == t % TPB
    untouched = set(range(num_blocks)) - set(src)
    assert all(paged[b] == [None] * TPB for b in untouched), "a block outside the ids was written"
    # Store from src, load into dst: the block-to-block copy the engine does.
    moved = [[None] * TPB for _ in range(num_blocks)]
    for s, d in zip(src, dst):
        moved[d] = list(paged[s])
    assert from_paged(moved, dst) == seq

    assert layer_verdicts([1.0, 2.0, 3.0, 4.0], 4.0) == []
    assert layer_verdicts([3.5, 2.0, 3.0, 4.0], 4.0) == [(0, 3.5, 1.75)]
    row = make_row(2048, prefill_ms=61.5, reload_ms=5.0, load_return_ms=0.2, layer_ms=[0.15 * (i + 1) for i in range(32)],
                   layer_total_ms=9.6, store_ms=5.2, h2d_ms=4.8, d2h_ms=4.9, first={"store_ms": 6, "store_call_ms": 0.25, "load_ms": 8},
                   store_call_ms=0.3, wait0_ms=0.5)
    assert abs(row["kv_gb"] - 0.268435456) < 1e-9
    v = targets(row)
    assert [ok for ok, _ in v] == [True] * 6, v
    slow = dict(row, floor_over_reload=0.5, d2h_over_store=0.91, layer_ms=[5.0] + row["layer_ms"][1:],
                store_call_ms=1.6, wait0_ms=1.01, first={"store_ms": 6.3})
    assert [ok for ok, _ in targets(slow)] == [False] * 6
    # 94% of the floor passes at 2k tokens, not from 8k.
    assert targets(dict(row, floor_over_reload=0.94))[0][0]
    assert not targets(dict(row, tokens=8192, floor_over_reload=0.94))[0][0]
    md = format_report("python3 bench/realmodel.py --selfcheck", {"gpu": "none"}, [row],
                       [(True, "2048 tokens: 128 blocks byte-exact")], 5, "2026-01-01T00:00:00Z")
    for want in ("| 2048 | 0.27 | 61.5 | 5.00 | 4.80 | 0.96 | 0.200 | 0.500 | 0.15 / 9.60 | 5.20 | 0.300 | 4.90 | 0.94 "
                 "| 12.3x |",
                 "- PASS: 2048 tokens: reload 5.00 ms", "| 2048 | 6.00 | 0.250 | 8.00 | nan |", "Command: `python3",
                 "- ok: 2048 tokens"):
        assert want in md, (want, md)
    tier_selfcheck()
    return md
