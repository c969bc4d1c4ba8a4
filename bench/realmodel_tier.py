"""The tier mode of bench/realmodel.py (--tier): TierBench, which writes
a prompt's KV to the disk tier or a Redis Cluster from one engine and
reloads it from there in a new one, and run_tiers, which runs it for each
prompt length and writes one report per tier (the tables are in
realmodel_report.py)."""

import os
import sys
import time

from realmodel_gpu import Bench, machine_info
from realmodel_report import (FILLER_POOLS, HEADER_BYTES, NAMESPACE, PREFETCH_TIMEOUT_S, TIER_POOL_SLACK, TPB, VOCAB,
                              format_tier_report, fs_type, kv_bytes, make_tier_row, median, tier_label, tier_out_path)


class TierBench(Bench):
    """The tier mode (--tier): per size, an engine that writes the KV to
    the tier and a second, new engine that reloads it from there (see
    TIER_METHOD); no engine of the bench's own."""

    def __init__(self, args):
        super().__init__(args, engine=False)
        self.tier_checks = {}
        self.notes = {}

    def tier_engine(self, kind, arg, nb, writer, subdir=None):
        """An engine over the paged cache whose host pool holds nb blocks
        plus TIER_POOL_SLACK, with the tier kind: the writer admits every
        evicted block to disk and bounds nothing it writes; the reader
        admits as the default does."""
        blk = kv_bytes(TPB)
        pool = (nb + TIER_POOL_SLACK) * blk
        cfg = dict(pool_bytes=pool, first_region_bytes=pool, namespace=NAMESPACE, policy="lru")
        if kind == "disk":
            # Room for the KV and the fillers the writer writes back too.
            cfg["disk"] = {"dirs": [subdir], "capacity_bytes": (nb + FILLER_POOLS * (nb + TIER_POOL_SLACK) + TIER_POOL_SLACK)
                           * (blk + HEADER_BYTES), "direct": "auto"}
            if writer:  # a bounce buffer for every eviction: none is dropped
                cfg["disk"].update(admit_all=True, write_back_bytes=FILLER_POOLS * pool)
        else:
            cfg["cluster"] = {"addrs": arg, "max_in_flight_bytes": 2 * pool, "ttl": 3600 * 10**9,
                              "timeout": int(PREFETCH_TIMEOUT_S * 1e9)}
        return self.kvo.Engine.from_tensors(self.kv, **cfg)

    def wait_cluster(self, eng, what):
        """Waits (up to PREFETCH_TIMEOUT_S) until eng's cluster tier is
        connected: before that its write-throughs and prefetches are
        skipped (counted unavailable)."""
        deadline = time.monotonic() + PREFETCH_TIMEOUT_S
        while not eng.stats()["cluster"]["available"]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: the cluster tier did not connect in {PREFETCH_TIMEOUT_S:g} s: "
                                   f"{eng.stats().get('cluster', {}).get('error', '')}")
            time.sleep(0.01)

    def check(self, kind, ok, text):
        self.tier_checks.setdefault(kind, []).append((bool(ok), text))
        return ok

    def fillers(self, eng, count, ids):
        """Stores count blocks of a fresh random prompt from GPU blocks
        ids (cycled): the pool's least recently used blocks make room."""
        toks = [self.rng.randrange(VOCAB) for _ in range(count * TPB)]
        keys = self.kvo.chain_keys(toks, TPB, namespace=NAMESPACE)
        for i in range(0, count, len(ids)):
            chunk = keys[i:i + len(ids)]
            _, outc = self.store(chunk, ids[:len(chunk)], eng=eng)
            if outc != ["stored"] * len(chunk):
                raise RuntimeError(f"filler store outcomes: {sorted(set(outc))}")

    def write(self, kind, arg, p, subdir):
        """Engine A: stores the KV and gets it onto the tier; closes.
        Returns the seconds from the store call until the tier holds it."""
        nb, keys, src = p["nb"], p["keys"], p["src"]
        # The KV back into its source blocks: a tier measured before this
        # one poisoned every block of the cache (tier_load), src included.
        idx = self.torch.tensor(src, device="cuda")
        for (pk, pv), (rk, rv) in zip(self.kv, p["ref"]):
            pk.index_copy_(0, idx, rk)
            pv.index_copy_(0, idx, rv)
        self.check(kind, self.bad_blocks(src, p["ref"]) == 0, f"{p['tokens']} tokens: the KV is in its source blocks before the writer stores it")
        eng = self.tier_engine(kind, arg, nb, writer=True, subdir=subdir)
        try:
            if kind == "cluster":
                self.wait_cluster(eng, "writer")
            t0 = time.perf_counter()
            _, outc = self.store(keys, src, eng=eng)
            if outc != ["stored"] * nb:
                raise RuntimeError(f"store outcomes: {sorted(set(outc))}")
            if kind == "disk":
                self.fillers(eng, FILLER_POOLS * (nb + TIER_POOL_SLACK), src)
                st = eng.stats()
                self.check(kind, st["disk"]["dropped"] == 0 and st["disk"]["write_errors"] == 0,
                           f"{p['tokens']} tokens: writer: {st['disk']['dropped']} write-backs dropped, "
                           f"{st['disk']['write_errors']} failed")
            else:
                deadline = time.monotonic() + PREFETCH_TIMEOUT_S
                while True:
                    st = eng.stats()
                    done = st["cluster"]["writes"] + st["cluster"]["write_errors"] + st["cluster"]["dropped"]
                    if done >= nb or time.monotonic() > deadline:
                        break
                    time.sleep(0.002)
                self.check(kind, st["cluster"]["writes"] == nb,
                           f"{p['tokens']} tokens: writer: {st['cluster']['writes']} of {nb} blocks written through "
                           f"({st['cluster']['write_errors']} failed, {st['cluster']['dropped']} dropped, "
                           f"{st['cluster']['unavailable_writes']} while unavailable)")
        finally:
            eng.close()  # the disk tier's queued write-backs finish here
        return time.perf_counter() - t0

    def tier_load(self, kind, eng, p, label):
        """One reload from the tier into p's dst blocks (poisoned first),
        checked: every block loaded, promoted from the tier, byte-exact.
        Returns (ms, call ms)."""
        nb, keys, dst = p["nb"], p["keys"], p["dst"]
        before = eng.stats()
        self.poison()
        if kind == "disk":
            ms, call, _, outc = self.load(keys, dst, eng=eng)
            got = eng.stats()["disk"]["hits"] - before["disk"]["hits"]
        else:
            ms, call, _, outc, pre = self.load(keys, dst, eng=eng, prefetch=True)
            got = pre["from_cluster"]
        bad = self.bad_blocks(dst, p["ref"])
        ok = outc == ["loaded"] * nb and got == nb and bad == 0
        if not ok or label:
            why = f" ({self.diagnose(dst, p['ref'])})" if bad else ""
            self.check(kind, ok, f"{p['tokens']} tokens: {label or 'a timed reload'}: {outc.count('loaded')} of {nb} "
                                 f"loaded, {got} from {tier_label(kind)}, {nb - bad} byte-exact{why}")
        return ms, call

    def run_tier_size(self, kind, arg, p):
        torch, args = self.torch, self.args
        nb, keys, dst, tokens = p["nb"], p["keys"], p["dst"], p["tokens"]
        subdir = None
        if kind == "disk":
            subdir = os.path.join(arg, f"kvo-realmodel-{os.getpid()}-{tokens}")
            os.makedirs(subdir, mode=0o700)
        try:
            write_s = self.write(kind, arg, p, subdir)
            t0 = time.perf_counter()
            eng = self.tier_engine(kind, arg, nb, writer=False, subdir=subdir)
            open_s = time.perf_counter() - t0
            try:
                if kind == "cluster":
                    self.wait_cluster(eng, "reader")
                    open_s = time.perf_counter() - t0
                st = eng.stats()
                held = eng.lookup(keys)
                self.check(kind, held == 0, f"{tokens} tokens: the new engine's pool holds {held} of the KV's blocks")
                if kind == "disk":
                    found = eng.stats()["disk"]["lookup_hits"] - st["disk"]["lookup_hits"]
                    self.check(kind, found == nb, f"{tokens} tokens: the new engine's lookup finds {found} of {nb} blocks "
                                                  f"on disk ({st['disk']['records']} records there, with the writer's fillers)")
                    self.notes.setdefault(kind, []).append(f"{tokens} tokens: disk mode {st.get('disk', {}).get('mode', '?')!r}")
                first_ms, _ = self.tier_load(kind, eng, p, "first reload, in the new engine")
                self.decode_check(p["orig"], p["first_token"], dst, f"{tokens} tokens, reloaded from {tier_label(kind)}")
                self.tier_checks[kind].append(self.checks.pop())
                nchecks = len(self.tier_checks[kind])  # a failed timed reload adds one
                tier, calls, host = [], [], []
                all_ok = True
                for _ in range(args.reps):
                    if kind == "disk":
                        self.fillers(eng, FILLER_POOLS * (nb + TIER_POOL_SLACK), p["src"])
                    else:
                        eng.delete(keys)
                    ms, call = self.tier_load(kind, eng, p, None)
                    tier.append(ms)
                    calls.append(call)
                    before = eng.stats()
                    self.poison()
                    ms, _, _, outc = self.load(keys, dst, eng=eng)
                    after = eng.stats()
                    ok = (outc == ["loaded"] * nb and self.bad_blocks(dst, p["ref"]) == 0
                          and after["disk"]["hits"] == before["disk"]["hits"] and after["cluster"]["hits"] == before["cluster"]["hits"])
                    if not ok:
                        self.check(kind, False, f"{tokens} tokens: a reload from host: {outc.count('loaded')} of {nb} "
                                                f"loaded, not all from host memory or not byte-exact")
                    all_ok = all_ok and ok and len(self.tier_checks[kind]) == nchecks
                    host.append(ms)
                self.check(kind, all_ok, f"{tokens} tokens: {args.reps} timed reloads from {tier_label(kind)}, each "
                                         f"then one from host: {'every block loaded from where it should and byte-exact' if all_ok else 'FAILURES above'}")
                st = eng.stats()
                self.notes.setdefault(kind, []).append(
                    f"{tokens} tokens: the reading engine's stats: " + ", ".join(
                        f"{k} {st[k]}" for k in sorted(st) if k.startswith(kind) and isinstance(st[k], (int, str))))
            finally:
                eng.close()
        finally:
            if subdir:
                import shutil
                shutil.rmtree(subdir, ignore_errors=True)
        torch.cuda.empty_cache()
        return make_tier_row(tokens, p["prefill_ms"], median(host), first_ms, median(tier), median(calls), write_s, open_s)


def run_tiers(args, tiers, command, started):
    """The tier mode: one report per tier; exit status 1 when a check failed."""
    import traceback
    t0 = time.perf_counter()
    b = TierBench(args)
    print(f"realmodel: model ready in {time.perf_counter() - t0:.1f} s ({b.num_blocks} GPU blocks per layer)",
          file=sys.stderr)
    rows = {kind: [] for kind, _ in tiers}
    try:
        for tokens in args.tokens:
            t1 = time.perf_counter()
            p = b.prepare(tokens)
            for kind, arg in tiers:
                t2 = time.perf_counter()
                try:
                    rows[kind].append(b.run_tier_size(kind, arg, p))
                except Exception as e:  # noqa: BLE001 - reported as a failed check; the other tier goes on
                    traceback.print_exc()
                    b.check(kind, False, f"{tokens} tokens: {type(e).__name__}: {e}")
                print(f"realmodel: {tokens} tokens from {tier_label(kind)} in {time.perf_counter() - t2:.1f} s",
                      file=sys.stderr)
            del p
            b.torch.cuda.empty_cache()
            print(f"realmodel: {tokens} tokens done in {time.perf_counter() - t1:.1f} s", file=sys.stderr)
    finally:
        b.close()
    machine = machine_info()
    ok = True
    for kind, arg in tiers:
        if kind == "disk":
            path = os.path.realpath(arg)
            try:
                with open("/proc/mounts") as f:
                    fs, mnt = fs_type(path, f.read())
            except OSError:
                fs, mnt = "?", "?"
            where = f"`{path}` ({fs}, mounted at {mnt})"
        else:
            where = "the seed node(s) " + ", ".join(f"`{a}`" for a in arg)
        checks = b.tier_checks.get(kind, [])
        ok = ok and bool(checks) and all(c for c, _ in checks)
        report = format_tier_report(command, machine, kind, where, rows[kind], checks, args.reps, started,
                                    b.notes.get(kind, ()))
        print(report)
        if args.out:
            path = tier_out_path(args.out, kind)
            with open(path, "w") as f:
                f.write(report)
            print(f"realmodel: wrote {path}", file=sys.stderr)
    if not ok:
        print("realmodel: MISMATCH or failure: see Checks", file=sys.stderr)
    return 0 if ok else 1
