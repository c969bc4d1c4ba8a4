"""Op and Lease, the handles an Engine's store, load and lookup return,
and the pool of the events recorded on their after= streams (_EventPool).
Private: kvoffload.engine and kvoffload re-export OUTCOMES, Op and Lease."""

import collections
import ctypes

from . import _lib, errors

# Per-block outcomes (kvo_op_outcomes), by code.
OUTCOMES = ("pending", "stored", "already-present", "refused-full", "refused-busy",
            "refused-admission", "failed", "loaded", "missing", "cancelled")

_WAIT_SLICE_NS = 50_000_000  # wait() returns to Python this often, so signals are handled


def _stream_handle(stream):
    """A CUstream as an int from a torch.cuda.Stream (or anything with
    .cuda_stream) or an int; None means no stream."""
    if stream is None:
        return 0
    if hasattr(stream, "cuda_stream"):
        return int(stream.cuda_stream)
    if isinstance(stream, int) and not isinstance(stream, bool):
        return _lib.check_int("stream", stream, 0, _lib.UINTPTR_MAX)
    raise errors.ArgumentTypeError(f"stream must be a torch.cuda.Stream or an int, got {type(stream).__name__}")


class _Handle:
    """A library handle in self._handle (0 once given back), given back by
    release() on leaving a with block, or by the C function named _FREE
    when collected unreleased (quietly: the interpreter may be shutting
    down)."""

    _FREE = ""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._handle:
            self.release()

    def __del__(self):
        if getattr(self, "_handle", 0) and _lib.in_loading_process():
            try:
                getattr(_lib.get(), self._FREE)(self._handle)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


class Lease(_Handle):
    """Reader leases taken by Engine.lookup(lease=True): the blocks cannot be
    evicted until release() or until a load takes the lease over."""

    _FREE = "kvo_lease_release"

    def __init__(self, engine, handle, hits):
        self._engine = engine
        self._handle = handle
        self.hits = hits

    def release(self):
        """Releases the leases. Raises ReleasedError the second time, or
        after a load took the lease over."""
        h, self._handle = self._handle, 0
        if not h:
            raise errors.ReleasedError("kvoffload: lease already released or taken over by a load")
        _lib.check(_lib.get().kvo_lease_release(h), "kvo_lease_release")

    def _take(self):
        return self._handle


class Op(_Handle):
    """One asynchronous store or load. Use as a context manager (released on
    exit) or call release(); its events are valid until then.

    Neither release() nor the finalizer ever waits for the op: an op not
    done yet is handed to its engine, which releases it (and gives its
    after= event back to the engine's pool) once it is done, at the
    engine's next store, load or close. Until then the op keeps alive the
    torch events its copies may still wait on or record."""

    _FREE = "kvo_op_release"

    def __init__(self, engine, handle, n, kind, keep=(), pooled=()):
        self._engine = engine
        self._handle = handle
        self._keep = tuple(keep)  # caller objects (a signal event) that must outlive the copies
        self._pooled = list(pooled)  # events of engine._events, given back once the op is done
        self.kind = kind
        self.n = n

    def _h(self):
        if not self._handle:
            raise errors.ReleasedError(f"kvoffload: {self.kind} op already released")
        return self._handle

    def wait(self, timeout=None):
        """Blocks until the op is done (timeout in seconds: OpTimeoutError
        when it passes; the op goes on). Returns the outcome names. Raises
        TransferFailedError if a block's copy failed. Signals are handled
        while it waits (KeyboardInterrupt interrupts it)."""
        lib = _lib.get()
        h = self._h()
        if timeout is not None:
            rc = lib.kvo_op_wait(h, _lib.timeout_ns("timeout", timeout))
        else:
            rc = lib.kvo_op_wait(h, _WAIT_SLICE_NS)
            while rc == errors.KVO_ETIMEOUT:
                rc = lib.kvo_op_wait(h, _WAIT_SLICE_NS)
        if rc in (errors.KVO_OK, errors.KVO_EFAIL):  # done, copies failed or not
            self._settle()
        _lib.check(rc, "kvo_op_wait")
        return self.outcomes()

    def done(self):
        """Whether the op is done (never blocks)."""
        d = ctypes.c_int(0)
        _lib.check(_lib.get().kvo_op_query(self._h(), ctypes.byref(d)), "kvo_op_query")
        if d.value:
            self._settle()
        return bool(d.value)

    def outcomes(self):
        """The per-block outcome names (see OUTCOMES), in key order.
        NotDoneError before the op is done."""
        buf = (ctypes.c_uint8 * max(self.n, 1))()
        _lib.check(_lib.get().kvo_op_outcomes(self._h(), buf, self.n), "kvo_op_outcomes")
        return [OUTCOMES[c] if c < len(OUTCOMES) else f"outcome({c})" for c in buf[:self.n]]

    def wait_stream(self, stream):
        """Makes stream (a torch.cuda.Stream or a CUstream int) wait on the
        GPU until the op's copies are done. The CPU waits only until the
        engine has enqueued them (store() and load() return before that);
        it never waits for the copies themselves."""
        _lib.check(_lib.get().kvo_op_stream_wait(self._h(), _stream_handle(stream)), "kvo_op_stream_wait")

    def event(self):
        """The op's completion CUevent as an int (0 on the host backend). It
        blocks until the engine has recorded it (the op's copies enqueued,
        not finished); a failure before that raises."""
        ev = ctypes.c_size_t(0)
        _lib.check(_lib.get().kvo_op_event(self._h(), ctypes.byref(ev)), "kvo_op_event")
        return ev.value

    def layer_event(self, layer):
        """The CUevent recorded after layer's copies of a per_layer load (0
        on the host backend). It blocks until that event is recorded (layer
        0's first, in small parts, while later layers are still being
        enqueued). InvalidArgumentError for a layer outside the layout, a
        store, or a load without per_layer."""
        layer = _lib.check_int("layer", layer, _lib.INT_MIN, _lib.INT_MAX)
        ev = ctypes.c_size_t(0)
        _lib.check(_lib.get().kvo_op_layer_event(self._h(), layer, ctypes.byref(ev)), "kvo_op_layer_event")
        return ev.value

    def wait_layer(self, layer, stream):
        """Makes stream wait until layer's copies of a per_layer load are done
        (cuStreamWaitEvent on layer_event(layer)): the CPU waits only until
        that layer's copies are enqueued, the GPU until they are done (the
        pattern of vLLM's wait_for_layer_load)."""
        ev = self.layer_event(layer)
        if ev:
            _cuda_stream_wait_event(_stream_handle(stream), ev)

    def _settle(self):
        """The op is done: its copies are issued and complete, so the events
        its copies waited on or recorded are free again. Each pooled event
        goes back once, even with several threads settling at once
        (list.pop is atomic)."""
        while True:
            try:
                ev = self._pooled.pop()
            except IndexError:
                break
            self._engine._events.put(ev)
        self._keep = ()

    def release(self):
        """Frees the op's handle and gives its events back; never waits: an
        op not done yet is released by its engine once done (see the class
        doc). Raises ReleasedError the second time."""
        h = self._h()
        self._handle = 0
        self._release(h)

    def _release(self, h):
        lib = _lib.get()
        d = ctypes.c_int(0)
        if lib.kvo_op_query(h, ctypes.byref(d)) == errors.KVO_OK and not d.value:
            pooled, self._pooled, keep, self._keep = self._pooled, [], self._keep, ()
            eng = self._engine
            eng._retiring.append((h, pooled, keep))
            if eng.closed:  # closed meanwhile (the op is done then): no reap will come
                eng._release_retiring()
            return
        self._settle()
        _lib.check(lib.kvo_op_release(h), "kvo_op_release")

    def __del__(self):
        h = getattr(self, "_handle", 0)
        if h and _lib.in_loading_process():
            self._handle = 0
            try:
                self._release(h)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


_libcuda = None


def _cuda_stream_wait_event(stream, event):
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
        _libcuda.cuStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        _libcuda.cuStreamWaitEvent.restype = ctypes.c_int
    rc = _libcuda.cuStreamWaitEvent(stream, event, 0)
    if rc != 0:
        raise errors.TransferFailedError(f"kvoffload: cuStreamWaitEvent(stream {stream:#x}, event {event:#x}) = {rc}")


class _EventPool:
    """The events an engine records on after= streams, reused.

    An event passed as StoreOptions.After / LoadOptions.After is waited on
    by the op's copies at its most recent record at the time they are
    issued, which may be after store()/load() return: recording it again
    before then would make them wait on the wrong work. So an event goes
    back to the pool only once the op that used it is done (Op._settle:
    after wait() or done() saw it done, or when the op is released done,
    or when its engine reaps it after a release while in flight); a call
    that fails gives it back at once (nothing was issued). Lock-free
    (deque.pop/append are atomic), so that a finalizer may give events
    back on any thread. At most keep idle events are kept."""

    def __init__(self, factory=None, keep=16):
        self._factory = factory or _torch_event
        self._free = collections.deque()
        self._keep = keep
        self.created = 0  # events made by factory (tests, stats)

    def get(self):
        try:
            return self._free.pop()
        except IndexError:
            self.created += 1
            return self._factory()

    def put(self, event):
        if len(self._free) < self._keep:
            self._free.append(event)

    def idle(self):
        return len(self._free)


def _torch_event():
    import torch
    return torch.cuda.Event()


def _record_on(stream, pool):
    """Records an event of pool on stream (a torch.cuda.Stream, or any
    object with .cuda_stream that pool's events can record on); returns
    (event, CUevent, CUstream)."""
    if not hasattr(stream, "cuda_stream"):
        raise errors.InvalidArgumentError(f"after must be a torch.cuda.Stream, got {type(stream).__name__}")
    event = pool.get()
    try:
        event.record(stream)
        return event, int(event.cuda_event), int(stream.cuda_stream)
    except BaseException:
        pool.put(event)
        raise
