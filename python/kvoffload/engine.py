"""Engine and Staging: the library's objects in Python (Op and Lease, the
handles Engine's calls return, are in _op; re-exported here)."""

import array
import collections
import ctypes
import json
import os
import struct
import time

from . import _lib, errors
from ._op import _WAIT_SLICE_NS, OUTCOMES, Lease, Op, _EventPool, _Handle, _record_on
from .keys import KEY_BYTES, ZERO_KEY, chain_keys, pack_keys
from .layout import layout_from_tensors


def _event_handle(event):
    if event is None:
        return 0
    if hasattr(event, "cuda_event"):
        return int(event.cuda_event)
    if isinstance(event, int) and not isinstance(event, bool):
        return _lib.check_int("signal", event, 0, _lib.UINTPTR_MAX)
    raise errors.ArgumentTypeError(f"signal must be a torch.cuda.Event or an int, got {type(event).__name__}")


def _block_ids(block_ids, n):
    """block_ids (a sequence of ints, or a tensor/array with .tolist()) as
    the int64_t array kvo_store/kvo_load take: a bool or non-integer is
    ArgumentTypeError, a value outside int64 InvalidArgumentError, each
    naming its index (the library checks the layout's range). An
    array.array("q") is taken as it is, without a check per id (the
    cheapest form for many blocks: about 0.1 µs a block less than a list
    on the H200 machine's CPU, bench/pycall.py)."""
    if type(block_ids) is array.array and block_ids.typecode == "q":
        if len(block_ids) != n:
            raise errors.InvalidArgumentError(f"{n} keys but {len(block_ids)} block ids")
        return block_ids
    if hasattr(block_ids, "tolist"):
        block_ids = block_ids.tolist()
    if block_ids is None or isinstance(block_ids, (str, bytes)):
        raise errors.ArgumentTypeError(f"block_ids must be a sequence of integers, got {type(block_ids).__name__}")
    try:
        block_ids = list(block_ids)
    except TypeError:
        raise errors.ArgumentTypeError(
            f"block_ids must be a sequence of integers, got {type(block_ids).__name__}") from None
    ids = None
    if list(map(type, block_ids)).count(int) == len(block_ids):
        # Plain ints (no bool, no other subclass): packed by struct, about
        # half the time of array's own conversion of a list.
        try:
            ids = array.array("q", struct.pack(f"{len(block_ids)}q", *block_ids))
        except struct.error:
            pass  # out of int64: the loop below names the id
    elif bool not in set(map(type, block_ids)):  # array takes bools as 0 and 1
        try:
            ids = array.array("q", block_ids)
        except (TypeError, OverflowError):
            pass  # the loop below names the id
    if ids is None:
        for i, b in enumerate(block_ids):
            _lib.check_int(f"block id {i}", b, _lib.INT64_MIN, _lib.INT64_MAX)
        raise errors.ArgumentTypeError("block ids must be integers")  # not reached
    if len(ids) != n:
        raise errors.InvalidArgumentError(f"{n} keys but {len(ids)} block ids")
    return ids


def _parents(parent, parents, n):
    """Store's parent (one key) and parents (n keys, None entries for
    ZERO_KEY) packed for kvo_store: (bytes or None, bytes or None)."""
    if parent is not None and parents is not None:
        raise errors.InvalidArgumentError("store: parent and parents both given; parents names every key's parent")
    if parent is not None:
        if not isinstance(parent, (bytes, bytearray, memoryview)) or len(bytes(parent)) != KEY_BYTES:
            raise errors.InvalidArgumentError(f"store: parent must be a {KEY_BYTES}-byte key, got {parent!r:.40}")
        return bytes(parent), None
    if parents is None:
        return None, None
    if isinstance(parents, (bytes, bytearray, memoryview)):
        raw, k = pack_keys(parents)
    else:
        raw, k = pack_keys([ZERO_KEY if p is None else p for p in parents])
    if k != n:
        raise errors.InvalidArgumentError(f"store: {n} keys but {k} parents")
    return None, raw


def _tokens(tokens):
    """Token ids as the uint32 array kvo_store_tokens takes."""
    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()
    try:
        return array.array("I", tokens)
    except (TypeError, OverflowError) as e:
        raise errors.InvalidArgumentError(f"store: tokens must be uint32 token ids: {e}") from None


def _addr(buf):
    """The address of a bytes object or array's data, for the call's duration."""
    if isinstance(buf, array.array):
        return buf.buffer_info()[0] if len(buf) else None
    return ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value if buf else None


class Staging:
    """A pinned host buffer at an address fixed for the engine's lifetime."""

    def __init__(self, name, ptr, device_ptr, nbytes):
        self.name, self.ptr, self.device_ptr, self.nbytes = name, ptr, device_ptr, nbytes

    def buffer(self):
        """The memory as a writable memoryview (valid until the engine closes)."""
        return memoryview((ctypes.c_uint8 * self.nbytes).from_address(self.ptr)).cast("B")

    def tensor(self, dtype=None):
        """The memory as a CPU torch tensor of dtype (default uint8)."""
        import torch
        t = torch.frombuffer(self.buffer(), dtype=torch.uint8)
        return t.view(dtype) if dtype is not None else t


class Engine(_Handle):
    """The offload engine. Build it from the KV cache tensors
    (Engine.from_tensors) or from a config dict (Engine(config)); close it
    with close() or a with block."""

    _FREE = "kvo_engine_destroy"

    def __init__(self, config, _keep=(), _socket=None):
        if not isinstance(config, dict):
            raise errors.ArgumentTypeError(f"config must be a dict, got {type(config).__name__}")
        try:
            text = json.dumps(config)  # escapes a NUL in a string: the library refuses it in the namespace
        except (TypeError, ValueError) as e:
            raise errors.ArgumentTypeError(f"kvoffload: config is not JSON: {e}") from e
        lib = _lib.get()
        h = ctypes.c_uint64(0)
        if _socket is None:
            _lib.check(lib.kvo_engine_create(text.encode(), ctypes.byref(h)), "kvo_engine_create")
        else:
            sock = _lib.c_string("socket", os.fspath(_socket))
            _lib.check(lib.kvo_engine_connect(sock, text.encode(), ctypes.byref(h)), "kvo_engine_connect")
        self._handle = h.value
        self._keep = _keep
        self._events = _EventPool()  # after= events, reused once their op is done
        self._retiring = collections.deque()  # (handle, pooled events, kept objects) of ops released in flight
        self.config = self._config()
        self.namespace = self.config.get("namespace", "")
        self.tokens_per_block = self.config["layout"]["tokens_per_block"]

    @classmethod
    def from_tensors(cls, kv_caches, pool_bytes, kind=None, tokens_per_block=None, kv_heads=None,
                     head_dim=None, layers=None, model_kv_heads=None, head_first=None, order=None, **config):
        """An engine over the serving stack's KV cache tensors (see
        kvoffload.layout for the accepted shapes). pool_bytes is the host
        pool size; other keyword arguments are Config fields (namespace,
        staging_bytes, policy, ...). A tensor-parallel rank whose tensors
        hold part of the model's heads gives model_kv_heads (the model's),
        head_first (its first head) and, for flattened or head-major
        tensors, order ("token-major" or "head-major"): every TP size then
        shares the blocks, and the namespace names neither the rank nor the
        TP size. The tensors must stay allocated while the engine lives;
        the engine keeps references to them."""
        pool_bytes = _lib.check_int("pool_bytes", pool_bytes, _lib.INT64_MIN, _lib.INT64_MAX)
        layout, backend, device, keep = layout_from_tensors(
            kv_caches, kind=kind, tokens_per_block=tokens_per_block, kv_heads=kv_heads,
            head_dim=head_dim, layers=layers, model_kv_heads=model_kv_heads, head_first=head_first, order=order)
        if backend == "host":
            raise errors.InvalidArgumentError(
                "kvoffload: KV tensors are on the cpu: the host backend's simulated GPU allocates its own "
                "memory; create the engine from a config dict (Engine({...})) and use sim_write/sim_read")
        cfg = dict(config, pool_bytes=pool_bytes, layout=layout)
        cfg.setdefault("backend", backend)
        cfg.setdefault("device", device)
        return cls(cfg, _keep=keep)

    @classmethod
    def connect(cls, socket, kv_caches=None, kind=None, tokens_per_block=None, kv_heads=None, head_dim=None,
                layers=None, **config):
        """An engine whose block index and host pool are those of the node
        serving socket (`kvoffload serve`), shared with every engine
        connected to it: what one process stores another loads.

        kv_caches: the KV cache tensors (as from_tensors takes them, CUDA
        tensors), or None: the layout then comes from config (a "layout"
        dict), and the engine either has no GPU (a scheduler: lookup with
        or without a lease, delete, clear, stats, events and trim only;
        store and load raise InvalidArgumentError) or, with
        backend="host", simulates one (sim_write / sim_read, as Engine
        does). Other keyword arguments are Config fields; the pool's (pool
        size, regions, huge pages) are the node's and ignored here.

        Raises UnavailableError when no node serves socket, and
        InvalidArgumentError when the node serves the namespace with
        another layout. While the node is away, lookup finds nothing,
        store reports "refused-busy" and load raises UnavailableError; the
        engine reconnects by itself (the new node's pool starts empty)."""
        cfg = dict(config)
        keep = ()
        if kv_caches is not None:
            layout, backend, device, keep = layout_from_tensors(
                kv_caches, kind=kind, tokens_per_block=tokens_per_block, kv_heads=kv_heads,
                head_dim=head_dim, layers=layers)
            if backend == "host":
                raise errors.InvalidArgumentError(
                    "kvoffload: KV tensors are on the cpu: pass kv_caches=None with a config layout "
                    "(backend=\"host\" simulates a GPU) instead")
            cfg["layout"] = layout
            cfg.setdefault("backend", backend)
            cfg.setdefault("device", device)
        return cls(cfg, _keep=keep, _socket=socket)

    def _h(self):
        if not self._handle:
            raise errors.EngineClosedError("kvoffload: engine closed")
        return self._handle

    def _json(self, fn, call):
        need = ctypes.c_size_t(0)
        size = 4096
        while True:
            buf = ctypes.create_string_buffer(size)
            rc = fn(self._h(), buf, size, ctypes.byref(need))
            if rc == errors.KVO_EINVAL and need.value > size:
                size = need.value
                continue
            _lib.check(rc, call)
            return json.loads(buf.value.decode())

    def _config(self):
        return self._json(_lib.get().kvo_engine_config_json, "kvo_engine_config_json")

    def keys(self, tokens, parent=None):
        """The keys of a sequence's full blocks in this engine's namespace."""
        return chain_keys(tokens, self.tokens_per_block, namespace=self.namespace, parent=parent)

    def lookup(self, keys, lease=False):
        """How many leading keys are in the pool. With lease=True returns
        (hits, Lease or None); pass the lease to load()."""
        raw, n = pack_keys(keys)
        hits = ctypes.c_size_t(0)
        lh = ctypes.c_uint64(0)
        _lib.check(_lib.get().kvo_lookup(self._h(), _addr(raw), n, 1 if lease else 0, ctypes.byref(hits),
                                         ctypes.byref(lh)), "kvo_lookup")
        if not lease:
            return hits.value
        return hits.value, (Lease(self, lh.value, hits.value) if lh.value else None)

    def store(self, keys, block_ids, after=None, parent=None, parents=None, tokens=None):
        """Copies GPU blocks block_ids[i] to the pool under keys[i],
        asynchronously; returns an Op. after: the torch.cuda.Stream whose
        queued kernels write those blocks: an event (from the engine's pool,
        see _EventPool) is recorded on it now and the copies wait for it
        (nothing else is needed for ordering). Before the stack overwrites
        the blocks, its stream must op.wait_stream().

        parent / parents keep a sequence stored over several calls one chain
        (eviction then takes its tail, never its middle); give at most one.
        parent: the keys are one sequence's blocks in order and parent is
        the key of the block before keys[0] (None or ZERO_KEY: keys[0]
        starts the sequence). parents: for a call holding blocks of several
        sequences, one parent per key (None or ZERO_KEY: that key starts a
        sequence).

        tokens: the blocks' token ids, tokens_per_block per key in key order
        (len(keys) × tokens_per_block), carried into their BlockStored events
        (events()); None: events carry no tokens."""
        raw, n = pack_keys(keys)
        ids = _block_ids(block_ids, n)
        praw, psraw = _parents(parent, parents, n)
        h = self._h()
        self._reap()
        event, ev, st = None, 0, 0
        if after is not None:
            event, ev, st = _record_on(after, self._events)
        op = ctypes.c_uint64(0)
        try:
            if tokens is None:
                _lib.check(_lib.get().kvo_store(h, _addr(raw), _addr(ids), n, _addr(praw), _addr(psraw), ev, st,
                                                ctypes.byref(op)), "kvo_store")
            else:
                toks = _tokens(tokens)
                _lib.check(_lib.get().kvo_store_tokens(h, _addr(raw), _addr(ids), n, _addr(praw), _addr(psraw),
                                                       _addr(toks), len(toks), ev, st, ctypes.byref(op)),
                           "kvo_store_tokens")
        except BaseException:
            if event is not None:
                self._events.put(event)  # nothing was issued: free again
            raise
        return Op(self, op.value, n, "store", pooled=() if event is None else (event,))

    def load(self, keys, block_ids, lease=None, after=None, per_layer=False, signal=None):
        """Copies the blocks stored under keys[i] into GPU blocks
        block_ids[i], asynchronously; returns an Op (wait_stream it before
        reading the blocks). lease: from lookup(lease=True), taken over.
        after: a stream whose queued work must finish before the blocks are
        overwritten (an event of the engine's pool is recorded on it). per_layer: one event per layer (op.wait_layer).
        signal: a caller-owned torch.cuda.Event (or CUevent int) also
        recorded at completion."""
        raw, n = pack_keys(keys)
        ids = _block_ids(block_ids, n)
        lh = 0
        if lease is not None:
            if not isinstance(lease, Lease):
                raise errors.InvalidArgumentError(f"lease must be a Lease from lookup, got {type(lease).__name__}")
            lh = lease._take()
            if not lh:
                raise errors.ReleasedError("kvoffload: lease already released or taken over by a load")
        sig = _event_handle(signal)
        h = self._h()
        self._reap()
        event, ev = None, 0
        if after is not None:
            event, ev, _ = _record_on(after, self._events)
        op = ctypes.c_uint64(0)
        try:
            _lib.check(_lib.get().kvo_load(h, _addr(raw), _addr(ids), n, lh, ev, 1 if per_layer else 0, sig,
                                           ctypes.byref(op)), "kvo_load")
        except BaseException:
            if event is not None:
                self._events.put(event)  # nothing was issued: free again
            raise
        if lease is not None:
            lease._handle = 0
        keep = (signal,) if signal is not None and not isinstance(signal, int) else ()
        return Op(self, op.value, n, "load", keep=keep, pooled=() if event is None else (event,))

    def _reap(self):
        """Releases the ops released while in flight (Op.release, the
        finalizer) that are done now, giving their events back to the pool;
        never waits. Each entry is popped by one thread only."""
        retiring = self._retiring
        if not retiring:
            return
        lib = _lib.get()
        for _ in range(len(retiring)):
            try:
                entry = retiring.popleft()
            except IndexError:
                break
            h, pooled, _keep = entry
            d = ctypes.c_int(0)
            rc = lib.kvo_op_query(h, ctypes.byref(d))
            if rc == errors.KVO_OK and not d.value:
                retiring.append(entry)
                continue
            if rc == errors.KVO_OK:
                for ev in pooled:
                    self._events.put(ev)
            lib.kvo_op_release(h)  # done: frees the handle at once; its code is nobody's to see

    def _release_retiring(self):
        """After the engine is destroyed (every op done): releases the ops
        handed over by Op.release while in flight."""
        lib = _lib.get()
        while True:
            try:
                h, _, _ = self._retiring.popleft()
            except IndexError:
                return
            lib.kvo_op_release(h)

    def delete(self, keys):
        """Removes keys from the pool; returns how many were present."""
        raw, n = pack_keys(keys)
        out = ctypes.c_size_t(0)
        _lib.check(_lib.get().kvo_delete(self._h(), _addr(raw), n, ctypes.byref(out)), "kvo_delete")
        return out.value

    def prefetch(self, keys, timeout=None, background=False):
        """Promotes the blocks of keys (a chain) that the host pool lacks
        from the lower tiers (config "disk", then "cluster") into it, so
        that later lookups and loads find them; nothing is leased. timeout
        (seconds, > 0) bounds the wait (None: the cluster config's own for
        the cluster, none for the disk). What is missing or late is a miss,
        not an error. Returns {"promoted": n, "from_disk": d,
        "from_cluster": c}. With background=True it returns at once, the
        promotion running on a thread of the engine, and returns
        {"started": True}, or {"started": False} when 4 were running."""
        ns = 0
        if timeout is not None:
            ns = _lib.timeout_ns("timeout", timeout)
            if ns <= 0:
                raise errors.InvalidArgumentError(f"kvoffload: prefetch timeout must be above 0 seconds, got {timeout!r}")
        raw, n = pack_keys(keys)
        if background:
            started = ctypes.c_int(0)
            _lib.check(_lib.get().kvo_prefetch_background(self._h(), _addr(raw), n, ns, ctypes.byref(started)),
                       "kvo_prefetch_background")
            return {"started": bool(started.value)}
        out = [ctypes.c_size_t(0) for _ in range(3)]
        _lib.check(_lib.get().kvo_prefetch(self._h(), _addr(raw), n, ns, *[ctypes.byref(o) for o in out]),
                   "kvo_prefetch")
        return {"promoted": out[0].value, "from_disk": out[1].value, "from_cluster": out[2].value}

    def clear(self, namespace=None):
        """Removes every block of namespace (default: the engine's)."""
        ns = _lib.c_string("namespace", self.namespace if namespace is None else namespace)
        out = ctypes.c_size_t(0)
        _lib.check(_lib.get().kvo_clear(self._h(), ns, ctypes.byref(out)), "kvo_clear")
        return out.value

    def stats(self):
        """The engine's counters as a dict (see Go's offload.Stats): top-level
        counters and the dicts "pool", "copies", "disk", "cluster" and "node"
        (ABI 4), e.g. stats()["pool"]["regions"], stats()["disk"]["hits"]."""
        return self._json(_lib.get().kvo_stats_json, "kvo_stats_json")

    # ---- metrics and KV events ------------------------------------------

    def metrics_text(self):
        """The engine's metrics in the Prometheus text exposition format
        (what `kvoffload demo --metrics` serves at /metrics)."""
        return self._text(_lib.get().kvo_metrics_text, "kvo_metrics_text")

    def events(self, buffer=0, timeout=0.0, poll_interval=0.001):
        """An iterator over the engine's KV events, subscribed now: dicts in
        vLLM's field names ({"type": "BlockStored" | "BlockRemoved" |
        "AllBlocksCleared", "block_hashes": [key bytes], "parent_block_hash":
        key bytes or None, "token_ids", "block_size", "medium": "CPU"}), in
        the order the pool's index changed, each after the fact. buffer:
        events held for a slow reader (0: 65536); past it events are dropped
        and counted (events_dropped()), the engine never waits. The iterator
        ends once no event came for timeout seconds (0: when none is
        waiting; None: never, until the engine is closed). One subscription
        per engine: close() the iterator (or let it end) before another."""
        _lib.check(_lib.get().kvo_events_open(self._h(), _lib.check_int("events: buffer", buffer, 0, 1 << 30)),
                   "kvo_events_open")
        return self._event_iter(timeout, poll_interval)

    def _event_iter(self, timeout, poll_interval):
        try:
            idle_since = time.monotonic()
            while True:
                try:
                    batch = self._text(_lib.get().kvo_events_poll, "kvo_events_poll")
                except errors.EngineClosedError:
                    return
                evs = json.loads(batch)
                for ev in evs:
                    yield _event(ev)
                    if ev["type"] == "AllBlocksCleared":
                        return  # the engine closed
                if evs:
                    idle_since = time.monotonic()
                    continue
                if timeout is not None and time.monotonic() - idle_since >= timeout:
                    return
                time.sleep(poll_interval)
        finally:
            if self._handle:
                try:
                    _lib.get().kvo_events_close(self._handle)
                except Exception:
                    pass

    def events_dropped(self):
        """Events the open events() iterator lost because it was slow."""
        out = ctypes.c_uint64(0)
        _lib.check(_lib.get().kvo_events_dropped(self._h(), ctypes.byref(out)), "kvo_events_dropped")
        return out.value

    def _text(self, fn, call):
        need = ctypes.c_size_t(0)
        size = 1 << 14
        while True:
            buf = ctypes.create_string_buffer(size)
            rc = fn(self._h(), buf, size, ctypes.byref(need))
            if rc == errors.KVO_EINVAL and need.value > size:
                size = need.value
                continue
            _lib.check(rc, call)
            return buf.value.decode()

    def trim(self, nbytes, timeout=None):
        """Gives up to nbytes of pinned pool memory back; returns
        {"freed_bytes", "pending_bytes"}."""
        nbytes = _lib.check_int("trim: nbytes", nbytes, 0, _lib.INT64_MAX)
        t = _lib.timeout_ns("trim: timeout", timeout)
        freed, pending = ctypes.c_uint64(0), ctypes.c_uint64(0)
        _lib.check(_lib.get().kvo_trim(self._h(), nbytes, t, ctypes.byref(freed), ctypes.byref(pending)),
                   "kvo_trim")
        return {"freed_bytes": freed.value, "pending_bytes": pending.value}

    def staging(self, name, nbytes):
        """The pinned staging buffer called name, of exactly nbytes bytes."""
        raw = _lib.c_string("staging: name", name)
        nbytes = _lib.check_int("staging: nbytes", nbytes, 0, _lib.INT64_MAX)
        ptr, dev = ctypes.c_void_p(0), ctypes.c_uint64(0)
        _lib.check(_lib.get().kvo_staging(self._h(), raw, nbytes, ctypes.byref(ptr),
                                          ctypes.byref(dev)), "kvo_staging")
        return Staging(name, ptr.value or 0, dev.value, nbytes)

    def wait_grown(self, timeout=None):
        """Waits until background growth has ended: the whole pool pinned
        (True), or timeout seconds passed first (False; growth goes on, or
        stays paused). Raises GrowthError if growth stopped on an error (the
        engine keeps working with what it pinned), EngineClosedError if the
        engine is closed. timeout=None: no limit; 0: poll. Signals are
        handled while it waits (KeyboardInterrupt interrupts it)."""
        lib = _lib.get()
        limit = _lib.timeout_ns("wait_grown: timeout", timeout)  # checks it
        deadline = None if limit < 0 or limit == _lib.INT64_MAX else time.monotonic() + limit / 1e9
        while True:
            slice_ns = _WAIT_SLICE_NS
            if deadline is not None:
                slice_ns = min(slice_ns, max(0, int((deadline - time.monotonic()) * 1e9)))
            rc = lib.kvo_wait_grown(self._h(), slice_ns)
            if rc == errors.KVO_OK:
                return True
            if rc != errors.KVO_ETIMEOUT:
                _lib.check(rc, "kvo_wait_grown")
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def pause_growth(self):
        """Stops background pinning after the region in progress, until
        resume_growth(). Idempotent; never blocks."""
        _lib.check(_lib.get().kvo_pause_growth(self._h()), "kvo_pause_growth")

    def resume_growth(self):
        """Lets background pinning continue. Idempotent."""
        _lib.check(_lib.get().kvo_resume_growth(self._h()), "kvo_resume_growth")

    def sim_write(self, device_addr, data):
        """Host backend: writes bytes into the simulated GPU memory."""
        device_addr = _lib.check_int("sim_write: device_addr", device_addr, 0, _lib.UINT64_MAX)
        if isinstance(data, (str, int)):  # bytes(5) would be 5 zero bytes
            raise errors.ArgumentTypeError(f"sim_write: data must be bytes-like, got {type(data).__name__}")
        data = bytes(data)
        _lib.check(_lib.get().kvo_sim_write(self._h(), device_addr, _addr(data), len(data)), "kvo_sim_write")

    def sim_read(self, device_addr, nbytes):
        """Host backend: reads nbytes of simulated GPU memory."""
        device_addr = _lib.check_int("sim_read: device_addr", device_addr, 0, _lib.UINT64_MAX)
        nbytes = _lib.check_int("sim_read: nbytes", nbytes, 0, _lib.INT64_MAX)
        buf = ctypes.create_string_buffer(max(nbytes, 1))
        _lib.check(_lib.get().kvo_sim_read(self._h(), device_addr, buf, nbytes), "kvo_sim_read")
        return buf.raw[:nbytes]

    def close(self):
        """Closes the engine (waits for copies in flight). Idempotent."""
        h, self._handle = self._handle, 0
        if h:
            try:
                _lib.check(_lib.get().kvo_engine_destroy(h), "kvo_engine_destroy")
            finally:
                self._release_retiring()
        self._keep = ()

    def __del__(self):
        h = getattr(self, "_handle", 0)
        if h and _lib.in_loading_process():
            self._handle = 0
            try:
                _lib.get().kvo_engine_destroy(h)
                self._release_retiring()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    @property
    def backend(self):
        """The backend in use: "cuda" or "host" (a config's "auto" resolved)."""
        return self.config["backend"]

    @property
    def backend_reason(self):
        """Why the engine picked its backend (e.g. no libcuda for "auto")."""
        return self.stats().get("backend_reason", "")

    @property
    def device(self):
        """The CUDA device ordinal of the engine (0 on the host backend)."""
        return self.config.get("device", 0)

    @property
    def closed(self):
        return not self._handle

    def __exit__(self, *exc):
        self.close()


def abi_version():
    """The ABI version of the loaded library (loads it)."""
    return _lib.get().kvo_abi_version()


def library_pid():
    """The pid of the process that loaded the library (None if not loaded)."""
    return _lib._loaded_pid if _lib.loaded() else None


__all__ = ["Engine", "Op", "Lease", "Staging", "OUTCOMES", "abi_version", "library_pid"]


def _event(ev):
    """A kvo_events_poll object with its hex block hashes as key bytes."""
    if "block_hashes" in ev:
        ev["block_hashes"] = [bytes.fromhex(h) for h in ev["block_hashes"]]
    if ev["type"] == "BlockStored":
        p = ev.get("parent_block_hash")
        ev["parent_block_hash"] = None if p is None else bytes.fromhex(p)
    return ev
