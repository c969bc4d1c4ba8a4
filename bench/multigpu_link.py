"""The host link of every GPU of a machine, alone and with the others
copying at once: the reference for the runs on several GPUs (issue 29).

One pinned host buffer (cudaHostAlloc through torch; under unified
addressing it is portable to every device) serves every GPU. For each GPU
alone: H2D, D2H, and both ways at once on two streams; then every GPU at
once, each doing the same. Contiguous copies of --mib MiB, best of --reps,
timed with CUDA events per GPU (all GPUs' copies start together after a
barrier). Writes a markdown table to --out and prints it.

    python3 bench/multigpu_link.py --out FILE [--mib 1024] [--reps 5]
"""

import argparse
import os
import platform
import subprocess
import sys
import threading
import time


def sh(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"({cmd[0]}: {e})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    import torch

    n = torch.cuda.device_count()
    if n < 1:
        sys.exit("no CUDA device")
    nbytes = a.mib << 20
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    host[0].fill_(7)
    dev = []
    for d in range(n):
        with torch.cuda.device(d):
            dev.append((torch.empty(nbytes, dtype=torch.uint8, device=d), torch.empty(nbytes, dtype=torch.uint8, device=d),
                        torch.cuda.Stream(d), torch.cuda.Stream(d)))

    def one(d, kind):
        """GB/s of one copy kind on GPU d (events on its streams)."""
        a_dev, b_dev, s1, s2 = dev[d]
        with torch.cuda.device(d):
            start = torch.cuda.Event(enable_timing=True)
            end = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            torch.cuda.synchronize(d)
            start.record(s1)
            s2.wait_event(start)
            moved = 0
            used = []
            if kind in ("h2d", "both"):
                with torch.cuda.stream(s1):
                    a_dev.copy_(host[0], non_blocking=True)
                end[0].record(s1)
                moved += nbytes
                used.append(0)
            if kind in ("d2h", "both"):
                with torch.cuda.stream(s2):
                    host[1].copy_(b_dev, non_blocking=True)
                end[1].record(s2)
                moved += nbytes
                used.append(1)
            torch.cuda.synchronize(d)
            # Both ways: from the common start to the later end.
            ms = max(start.elapsed_time(end[i]) for i in used)
            return moved / (ms / 1e3) / 1e9

    def best(devices, kind):
        rates = {d: 0.0 for d in devices}
        for _ in range(a.reps):
            barrier = threading.Barrier(len(devices))
            got = {}

            def run(d):
                barrier.wait()
                got[d] = one(d, kind)
            ts = [threading.Thread(target=run, args=(d,)) for d in devices]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            for d in devices:
                rates[d] = max(rates[d], got[d])
        return rates

    for d in range(n):
        for k in ("h2d", "d2h", "both"):
            one(d, k)  # warm-up
    rows = []
    for k in ("h2d", "d2h", "both"):
        alone = {d: best([d], k)[d] for d in range(n)}
        together = best(list(range(n)), k) if n > 1 else alone
        for d in range(n):
            rows.append((d, k, alone[d], together[d]))

    out = ["# The host link of each GPU, alone and with the others copying at once",
           "",
           f"Command: `python3 bench/multigpu_link.py --out {a.out} --mib {a.mib} --reps {a.reps}`  ",
           f"Date: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}  ",
           f"Machine: {n} × {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {os.cpu_count()} CPUs, {platform.release()}",
           "",
           f"Contiguous copies of {a.mib} MiB between one pinned host buffer and each GPU, best of {a.reps}, CUDA events; both ways: two streams from one start event to the later end.",
           "",
           "| GPU | copy | alone GB/s | all GPUs at once GB/s | together / alone |",
           "|---:|---|---:|---:|---:|"]
    for d, k, al, to in rows:
        out.append(f"| {d} | {k} | {al:.1f} | {to:.1f} | {to / al:.0%} |")
    out += ["", "## nvidia-smi topo -m", "", "```", sh(["nvidia-smi", "topo", "-m"]), "```", "",
            "## PCIe links and NUMA", "", "```",
            sh(["nvidia-smi", "--query-gpu=index,pci.bus_id,pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,pcie.link.width.max", "--format=csv"]),
            sh(["sh", "-c", "for f in /sys/bus/pci/devices/*/numa_node; do :; done; nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | while read b; do b=$(echo $b | tr A-Z a-z | sed 's/^0000//; s/^0*//'); for p in /sys/bus/pci/devices/*$b; do echo \"$b numa_node $(cat $p/numa_node 2>/dev/null)\"; done; done"]),
            "```", ""]
    text = "\n".join(out)
    with open(a.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
