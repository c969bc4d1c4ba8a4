#!/usr/bin/env python3
"""One table: the engine's figures (DIR/summary.json from `kvoffload bench
--out DIR`) beside the PyTorch peers' (DIR/peers.json from peers.py).

    python3 bench/probes/peers/merge.py DIR        # prints markdown, writes DIR/comparison.md
"""

import json
import os
import sys


def fmt_size(n):
    for unit, v in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= v:
            return f"{n / v:g} {unit}"
    return f"{n} B"


def gb(v):
    return "–" if v is None else f"{v:.1f}"


def engine_rate(rows, method, direction, seg, ctas=None):
    for r in rows:
        if (r["method"] == method and r["dir"] == direction and r["seg_bytes"] == seg
                and r.get("background", "none") == "none" and (ctas is None or r["ctas"] == ctas)):
            return r["gbps"]
    return None


def peer_rate(rows, method, direction, seg):
    for r in rows:
        if r["method"] == method and r["dir"] == direction and r["seg_bytes"] == seg:
            return r["gbps"]
    return None


def comparison(engine, peers):
    out = ["# kvoffload beside PyTorch", ""]
    thr = engine.get("throughput") or {}
    rows = thr.get("rows") or []
    link = thr.get("link_gbps") or {}
    out.append(f"Engine: `{engine.get('command', '?')}` on {thr.get('device', '?')}; "
               f"peers: PyTorch {peers.get('torch', '?')} on {peers.get('device', '?')} (`{peers.get('command', '?')}`).")
    out += ["", "## Scattered blocks, GB/s (best of the reps; same machine, same run)", "",
            "| dir | block | link | kvoffload auto | kvoffload kernel/8 | kvoffload batch | kvoffload memcpy | "
            "torch copy_ loop | torch index_select + copy (needs GPU staging = batch) |",
            "|---|---|---|---|---|---|---|---|---|"]
    segs = sorted({r["seg_bytes"] for r in peers.get("copies", [])} |
                  {r["seg_bytes"] for r in rows if r["method"] != "contiguous"})
    for d in ("d2h", "h2d"):
        for seg in segs:
            out.append(" | ".join([
                f"| {d}", fmt_size(seg), gb(link.get(d)),
                gb(engine_rate(rows, "auto", d, seg)), gb(engine_rate(rows, "kernel", d, seg, ctas=8)),
                gb(engine_rate(rows, "batch", d, seg)), gb(engine_rate(rows, "memcpy", d, seg)),
                gb(peer_rate(peers.get("copies", []), "copy_loop", d, seg)),
                gb(peer_rate(peers.get("copies", []), "index_select", d, seg)) + " |"]))
    out += ["", "## Pinned memory", "",
            "| size asked | kvoffload s (ms/GiB) | kvoffload owned | torch pin_memory s (ms/GiB) | torch owned |",
            "|---|---|---|---|---|"]
    ours = {r["size_bytes"]: r for r in engine.get("pinning") or []}
    theirs = {r["size_bytes"]: r for r in peers.get("pin_memory") or []}
    for size in sorted(set(ours) | set(theirs)):
        o, t = ours.get(size), theirs.get(size)
        gib = size / (1 << 30)
        o_time = "–" if o is None else f"{o['total_s']:.2f} ({o['total_s'] * 1000 / gib:.0f})"
        o_owned = "–" if o is None else fmt_size(o["mapped_bytes"])
        t_time = "–" if t is None else f"{t['seconds']:.2f} ({t['ms_per_gib']:.0f})"
        t_owned = "–" if t is None else fmt_size(t["owned_bytes"] if t["owned_bytes"] is not None else t["rss_delta_bytes"])
        out.append(f"| {fmt_size(size)} | {o_time} | {o_owned} | {t_time} | {t_owned} |")
    return "\n".join(out) + "\n"


def main(argv):
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr if len(argv) != 1 else sys.stdout)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    d = argv[0]
    try:
        with open(os.path.join(d, "summary.json")) as f:
            engine = json.load(f)
        with open(os.path.join(d, "peers.json")) as f:
            peers = json.load(f)
    except (OSError, ValueError) as e:
        print(f"merge.py: {e}", file=sys.stderr)
        return 1
    text = comparison(engine, peers)
    with open(os.path.join(d, "comparison.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
