"""The Go runtime inside Python: signals still reach Python's handlers,
the runtime's threads keep asynchronous signals blocked, the library caps
GOMAXPROCS without touching os.environ, a forked child is refused, and a growth error is reported."""

import os
import resource
import subprocess
import sys
import textwrap
import unittest

import kvoffload

from .helpers import host_config, keys_for, needs_library

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SIGNAL_SCRIPT = textwrap.dedent("""
    import ctypes, os, signal, sys, threading, time
    # Python's own SIGINT handler, as at a normal start, before the library
    # loads: a process started with SIGINT ignored (a background job of a
    # shell without job control) keeps it ignored, and the loop below
    # would never be interrupted.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import kvoffload
    from kvoffload import _lib
    from tests.helpers import host_config, keys_for, write_block

    env = dict(os.environ)
    eng = kvoffload.Engine(host_config(sim={"seed": 1, "min_delay_ns": 200000, "max_delay_ns": 2000000}))
    assert dict(os.environ) == env, "loading the library changed os.environ"
    procs = eng.stats()["go_maxprocs"]
    if sys.argv[1].startswith("max:"):  # the runtime's default (CPUs, cgroup limit), capped
        assert 1 <= procs <= int(sys.argv[1][4:]), (procs, sys.argv[1])
    else:
        assert procs == int(sys.argv[1]), (procs, sys.argv[1])

    def round_trip(i):
        keys = keys_for(4, 1000 + i)
        for b in range(4):
            write_block(eng, b, i)
        with eng.store(keys, range(4)) as op:
            op.wait()
        with eng.load(keys, range(4, 8)) as op:
            assert op.wait() == ["loaded"] * 4
        eng.delete(keys)

    # SIGINT while transfers run: KeyboardInterrupt in the main thread.
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    rounds = 0
    try:
        while True:
            round_trip(rounds)
            rounds += 1
    except KeyboardInterrupt:
        pass
    timer.join()
    round_trip(rounds + 1)  # the engine still works

    # Every thread but Python's main thread is the Go runtime's here; all
    # keep SIGINT and SIGTERM blocked, so the kernel delivers them to Python.
    bits = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
    tids = [t for t in os.listdir("/proc/self/task") if int(t) != os.getpid()]
    assert tids, "no Go threads"
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                blk = next(int(l.split()[1], 16) for l in f if l.startswith("SigBlk:"))
        except FileNotFoundError:
            continue
        assert blk & bits == bits, f"thread {tid} does not block SIGINT/SIGTERM: SigBlk {blk:#x}"

    # A handler installed after the load (SIGTERM) runs, with SA_ONSTACK.
    got = []
    signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    for _ in range(3):
        round_trip(rounds + 2)
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.time() + 10
    while not got and time.time() < deadline:
        round_trip(rounds + 3)
    assert got == [signal.SIGTERM], got

    class Sigaction(ctypes.Structure):
        _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16), ("flags", ctypes.c_int),
                    ("restorer", ctypes.c_void_p)]
    libc = ctypes.CDLL(None)
    SA_ONSTACK = 0x08000000
    for s in (signal.SIGINT, signal.SIGTERM):
        sa = Sigaction()
        assert libc.sigaction(s, None, ctypes.byref(sa)) == 0
        assert sa.flags & SA_ONSTACK, f"signal {s} handler lacks SA_ONSTACK: flags {sa.flags:#x}"
    eng.close()
    print("signals ok after", rounds, "rounds")
""")


GROWTH_ERROR_SCRIPT = textwrap.dedent("""
    import resource
    import kvoffload
    from tests.helpers import host_config, keys_for, write_block

    # A first region of 1 MiB, then 4 GiB regions that the address-space
    # limit set below refuses. The limit is set before the engine starts,
    # so that no region is mapped or being mapped ahead when it takes
    # effect (PauseGrowth lets a prefetch in progress finish, and a region
    # mapped just before the limit left the Go heap no room to take it in:
    # "fatal error: out of memory", seen on CI). An engine made and closed
    # first loads the library and starts the Go runtime outside the limit.
    # The 2 GiB of room are for what the process maps besides regions: new
    # 64 MiB Go heap arenas, thread stacks, and glibc's malloc arenas (64
    # MiB each, up to 8 per core: 256 MiB of room was not enough for them
    # with GOMAXPROCS=64 on 2 cores).
    kvoffload.Engine(host_config()).close()
    with open("/proc/self/status") as f:
        vm = next(int(l.split()[1]) for l in f if l.startswith("VmSize:")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), resource.RLIM_INFINITY))
    cfg = host_config(pool_bytes=16 << 30, first_region_bytes=1 << 20, region_bytes=4 << 30, staging_bytes=4096)
    cfg["layout"] = dict(cfg["layout"], head_dim=64, num_blocks=8)
    eng = kvoffload.Engine(cfg)
    for timeout in (30, None, 0):
        try:
            eng.wait_grown(timeout)
            raise SystemExit(f"wait_grown({timeout}) returned after growth failed")
        except kvoffload.GrowthError as e:
            assert e.code == kvoffload.errors.KVO_EGROWTH and "cannot allocate memory" in str(e), (e.code, str(e))
    st = eng.stats()
    assert st["pool"]["growth_error"] and st["pool"]["regions"] == 1 and st["pool"]["regions_total"] > 1, st
    keys = keys_for(2, 5)  # the engine works with the region it has
    write_block(eng, 0, 1)
    write_block(eng, 1, 1)
    with eng.store(keys, [0, 1]) as op:
        assert op.wait() == ["stored", "stored"]
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    eng.close()
    print("growth error ok")
""")


def _ncpu():
    return len(os.sched_getaffinity(0))


@needs_library
class Signals(unittest.TestCase):
    def run_script(self, env, want):
        proc = subprocess.run([sys.executable, "-c", SIGNAL_SCRIPT, want], cwd=PYTHON_DIR, env=env,
                              capture_output=True, text=True, timeout=120)
        self.assertEqual(proc.returncode, 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
        self.assertIn("signals ok", proc.stdout)

    def test_sigint_during_transfers(self):
        env = {k: v for k, v in os.environ.items() if k != "GOMAXPROCS"}
        self.run_script(env, f"max:{min(_ncpu(), 8)}")

    def test_gomaxprocs_of_the_user_kept(self):
        self.run_script(dict(os.environ, GOMAXPROCS="3"), "3")


@needs_library
class Growth(unittest.TestCase):
    def test_growth_error(self):
        # Thread stacks of 1 MiB (glibc sizes them from RLIMIT_STACK at
        # exec) so that the address-space limit leaves room for threads.
        def small_stacks():
            resource.setrlimit(resource.RLIMIT_STACK, (1 << 20, resource.getrlimit(resource.RLIMIT_STACK)[1]))

        proc = subprocess.run([sys.executable, "-c", GROWTH_ERROR_SCRIPT], cwd=PYTHON_DIR, capture_output=True,
                              text=True, timeout=120, preexec_fn=small_stacks)
        self.assertEqual(proc.returncode, 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
        self.assertIn("growth error ok", proc.stdout)


@needs_library
class Fork(unittest.TestCase):
    def test_child_refused(self):
        eng = kvoffload.Engine(host_config())
        self.addCleanup(eng.close)
        keys = keys_for(1, 11)
        eng.store(keys, [0]).wait()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                eng.lookup(keys)
            except kvoffload.ForkedChildError as e:
                code = 0 if "fork" in str(e) else 2
            except BaseException:  # noqa: BLE001 - any other outcome fails the test
                code = 3
            try:
                kvoffload.Engine(host_config())
                code = 4
            except kvoffload.ForkedChildError:
                pass
            except BaseException:  # noqa: BLE001
                code = 5
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        self.assertTrue(os.WIFEXITED(status))
        self.assertEqual(os.WEXITSTATUS(status), 0, "child was not refused with ForkedChildError")
        self.assertEqual(eng.lookup(keys), 1)  # the parent is unaffected


if __name__ == "__main__":
    unittest.main()
