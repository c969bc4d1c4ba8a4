"""Describing a serving stack's KV cache tensors as an engine layout.

Works on torch tensors without importing torch: it reads only .device,
.dtype, .shape, .stride(), .is_contiguous(), .element_size() and
.data_ptr(), so it is testable with stand-ins.

Accepted forms (num_blocks first everywhere, each tensor contiguous):

* layer-separate: a list with one entry per layer, each a (K, V) pair of
  tensors of shape [num_blocks, tokens_per_block, kv_heads, head_dim] (or
  flattened to [num_blocks, tokens_per_block * kv_heads * head_dim], with
  the geometry given), or one tensor of shape [2, num_blocks, ...] holding
  K and V (vLLM's per-layer cache);
* cross-layer: one tensor [num_blocks, layers, 2, tokens_per_block,
  kv_heads, head_dim] (or [num_blocks, block_elements], geometry given);
* mla: a list of one tensor per layer, [num_blocks, tokens_per_block,
  latent] (kv_heads = 1, head_dim = latent).

Tensor parallelism: kv_heads is what the tensors hold (the rank's heads).
Give model_kv_heads (the model's KV heads, all ranks together) and
head_first (the rank's first head) so that every TP size shares the
blocks: the ranks' stores fill one slot, and any TP size loads its own
heads. That needs the GPU order: order="token-major" (the shapes above) or
"head-major" ([num_blocks, kv_heads, tokens_per_block, head_dim] per layer,
[..., 2, kv_heads, tokens_per_block, head_dim] cross-layer); with
model_kv_heads and unflattened shapes it defaults to token-major. The
namespace then names neither the rank nor the TP size.
"""

from .errors import InvalidArgumentError

LAYER_SEPARATE = "layer-separate"
CROSS_LAYER = "cross-layer"
MLA = "mla"
TOKEN_MAJOR = "token-major"
HEAD_MAJOR = "head-major"


def _bad(msg):
    return InvalidArgumentError("kvoffload: KV tensors: " + msg)


def _check_tensor(t, what):
    for attr in ("device", "shape", "data_ptr", "is_contiguous", "element_size", "stride"):
        if not hasattr(t, attr):
            raise _bad(f"{what} is a {type(t).__name__}, not a tensor")
    if not t.is_contiguous():
        raise _bad(f"{what} is not contiguous (strides {tuple(t.stride())}); pass .contiguous() storage, not a view")
    if len(t.shape) < 2:
        raise _bad(f"{what} has shape {tuple(t.shape)}: needs [num_blocks, ...]")


def _device_of(tensors):
    """(backend, device index) for tensors that must all be on one device."""
    first = tensors[0][1].device
    for what, t in tensors:
        d = t.device
        if d.type != first.type or d.index != first.index:
            raise _bad(f"{what} is on {d}, {tensors[0][0]} on {first}: all must be on one device")
    if first.type == "cuda":
        return "cuda", first.index or 0
    if first.type == "cpu":
        return "host", 0
    raise _bad(f"tensors are on {first}; the engine needs cuda tensors (or cpu for the host backend)")


def _geometry(shape, what, tokens_per_block, kv_heads, head_dim, lead, order=None):
    """(tokens_per_block, kv_heads, head_dim) from a block's shape after the
    num_blocks dimension; lead is the number of leading dims (layers, 2) of a
    cross-layer block. A head-major block is [kv_heads, tokens_per_block,
    head_dim]."""
    inner = tuple(shape[1:])
    if len(inner) == lead + 3:
        got = inner[lead:]
        if order == HEAD_MAJOR:
            got = (got[1], got[0], got[2])
        for name, given, actual in zip(("tokens_per_block", "kv_heads", "head_dim"),
                                       (tokens_per_block, kv_heads, head_dim), got):
            if given is not None and given != actual:
                raise _bad(f"{what} has shape {tuple(shape)}: {name} is {actual}, {given} was given")
        return got
    if len(inner) == 1:
        if None in (tokens_per_block, kv_heads, head_dim):
            raise _bad(f"{what} has flattened shape {tuple(shape)}: give tokens_per_block, kv_heads and head_dim")
        return tokens_per_block, kv_heads, head_dim
    raise _bad(f"{what} has shape {tuple(shape)}: want [num_blocks, tokens_per_block, kv_heads, head_dim] "
               f"or [num_blocks, elements]")


def _check_order(order):
    if order not in (None, TOKEN_MAJOR, HEAD_MAJOR):
        raise _bad(f"order {order!r}: must be {TOKEN_MAJOR!r}, {HEAD_MAJOR!r} or None (undeclared)")


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _heads(layout, model_kv_heads, head_first, order, flattened):
    """Adds the rank's head range and the GPU order to layout (in place):
    model_kv_heads, head_first and order, checked against its kv_heads."""
    heads = layout["kv_heads"]
    if model_kv_heads is None:
        if head_first not in (None, 0):
            raise _bad(f"head_first = {head_first!r} without model_kv_heads: a head range needs the model's KV heads")
        if order is not None:
            layout["order"] = order
        return layout
    if not _is_int(model_kv_heads) or model_kv_heads < 1:
        raise _bad(f"model_kv_heads = {model_kv_heads!r}: must be an integer of at least 1")
    if layout["kind"] == MLA and model_kv_heads != 1:
        raise _bad(f"mla has one latent vector per token: model_kv_heads = {model_kv_heads!r}, must be 1")
    if head_first is None:
        head_first = 0
    if not _is_int(head_first) or head_first < 0:
        raise _bad(f"head_first = {head_first!r}: must be an integer of at least 0")
    if heads > model_kv_heads or head_first > model_kv_heads - heads:
        raise _bad(f"heads [{head_first}, {head_first + heads}) (head_first {head_first}, kv_heads {heads}) "
                   f"outside the model's model_kv_heads = {model_kv_heads} heads [0, {model_kv_heads})")
    if order is None:
        if flattened:
            raise _bad(f"flattened tensors with model_kv_heads: give order ({TOKEN_MAJOR!r} or {HEAD_MAJOR!r})")
        order = TOKEN_MAJOR
    layout.update(model_kv_heads=model_kv_heads, head_first=head_first, order=order)
    return layout


def layout_from_tensors(kv_caches, kind=None, tokens_per_block=None, kv_heads=None, head_dim=None, layers=None,
                        model_kv_heads=None, head_first=None, order=None):
    """Returns (layout dict for the engine config, backend, device index,
    tensors to keep alive). model_kv_heads, head_first and order describe a
    tensor-parallel rank's share of the model's heads (see the module's
    doc)."""
    _check_order(order)
    if isinstance(kv_caches, (list, tuple)):
        if not kv_caches:
            raise _bad("an empty list: need one entry per layer")
        kind = kind or (MLA if all(not isinstance(x, (list, tuple)) and len(x.shape) == 3 for x in kv_caches)
                        else LAYER_SEPARATE)
        if kind == CROSS_LAYER:
            raise _bad("cross-layer takes one tensor, not a list")
        layout, backend, device, keep, flat = _per_layer(kv_caches, kind, tokens_per_block, kv_heads, head_dim, order)
    else:
        if kind not in (None, CROSS_LAYER):
            raise _bad(f"kind {kind!r} takes a list of per-layer tensors")
        layout, backend, device, keep, flat = _cross_layer(kv_caches, tokens_per_block, kv_heads, head_dim, layers, order)
    return _heads(layout, model_kv_heads, head_first, order, flat), backend, device, keep


def _per_layer(kv_caches, kind, tpb, heads, dim, order=None):
    entries = []
    for l, entry in enumerate(kv_caches):
        if kind == MLA:
            if isinstance(entry, (list, tuple)):
                raise _bad(f"layer {l}: mla takes one latent tensor per layer, got {len(entry)}")
            _check_tensor(entry, f"layer {l}")
            entries.append((entry, None))
            continue
        if isinstance(entry, (list, tuple)):
            if len(entry) != 2:
                raise _bad(f"layer {l}: a (K, V) pair is needed, got {len(entry)} tensors")
            k, v = entry
        else:
            _check_tensor(entry, f"layer {l}")
            if entry.shape[0] != 2:
                raise _bad(f"layer {l} has shape {tuple(entry.shape)}: one tensor per layer must be [2, num_blocks, ...]")
            k, v = entry[0], entry[1]
        _check_tensor(k, f"layer {l} K")
        _check_tensor(v, f"layer {l} V")
        entries.append((k, v))
    first = entries[0][0]
    named = []
    for l, (k, v) in enumerate(entries):
        named.append((f"layer {l} K" if v is not None else f"layer {l}", k))
        if v is not None:
            named.append((f"layer {l} V", v))
    backend, device = _device_of(named)
    num_blocks = first.shape[0]
    elsize = first.element_size()
    if kind == MLA and heads not in (None, 1):
        raise _bad(f"mla has one latent vector per token: kv_heads = {heads!r} was given, must be 1 (or omitted)")
    if kind == MLA:
        if len(first.shape) == 3:
            shape_tpb, latent = first.shape[1], first.shape[2]
            if tpb is not None and tpb != shape_tpb:
                raise _bad(f"layer 0 has shape {tuple(first.shape)}: tokens_per_block is {shape_tpb}, {tpb} was given")
            if dim is not None and dim != latent:
                raise _bad(f"layer 0 has shape {tuple(first.shape)}: head_dim (the latent size) is {latent}, {dim} was given")
            geo = (shape_tpb, 1, latent)
        else:
            geo = _geometry(first.shape, "layer 0", tpb, 1, dim, 0)
    else:
        geo = _geometry(first.shape, "layer 0 K", tpb, heads, dim, 0, order)
    tensors = []
    for what, t in named:
        if tuple(t.shape) != tuple(first.shape):
            raise _bad(f"{what} has shape {tuple(t.shape)}, layer 0 has {tuple(first.shape)}: all must match")
        if t.dtype != first.dtype:
            raise _bad(f"{what} has dtype {t.dtype}, layer 0 has {first.dtype}: all must match")
    block_elems = geo[0] * geo[1] * geo[2]
    row = 1
    for d in first.shape[1:]:
        row *= d
    if row != block_elems:
        raise _bad(f"layer 0 has {row} elements per block, tokens_per_block*kv_heads*head_dim = {block_elems}")
    for k, v in entries:
        stride = k.stride()[0] * elsize
        if v is not None and v.stride()[0] * elsize != stride:
            raise _bad("K and V of a layer must have the same block stride")
        tensors.append({"k": k.data_ptr(), "v": v.data_ptr() if v is not None else 0, "stride": stride})
    layout = {
        "kind": kind, "layers": len(entries), "kv_heads": geo[1], "head_dim": geo[2],
        "dtype_bytes": elsize, "tokens_per_block": geo[0], "num_blocks": num_blocks,
        "layer_tensors": tensors,
    }
    keep = [t for _, t in named]
    return layout, backend, device, keep, len(first.shape) == 2


def _cross_layer(t, tpb, heads, dim, layers, order=None):
    _check_tensor(t, "the cross-layer tensor")
    backend, device = _device_of([("the cross-layer tensor", t)])
    shape = tuple(t.shape)
    if len(shape) == 6:
        if shape[2] != 2:
            raise _bad(f"cross-layer tensor has shape {shape}: dim 2 must be 2 (K and V)")
        if layers is not None and layers != shape[1]:
            raise _bad(f"cross-layer tensor has shape {shape}: layers is {shape[1]}, {layers} was given")
        layers = shape[1]
        geo = _geometry((shape[0],) + shape[3:], "the cross-layer tensor", tpb, heads, dim, 0, order)
    elif len(shape) == 2:
        if None in (tpb, heads, dim, layers):
            raise _bad(f"cross-layer tensor has flattened shape {shape}: give layers, tokens_per_block, kv_heads and head_dim")
        geo = (tpb, heads, dim)
        if shape[1] != layers * 2 * tpb * heads * dim:
            raise _bad(f"cross-layer tensor has {shape[1]} elements per block, "
                       f"layers*2*tokens_per_block*kv_heads*head_dim = {layers * 2 * tpb * heads * dim}")
    else:
        raise _bad(f"cross-layer tensor has shape {shape}: want [num_blocks, layers, 2, tokens_per_block, "
                   f"kv_heads, head_dim] or [num_blocks, elements]")
    elsize = t.element_size()
    layout = {
        "kind": CROSS_LAYER, "layers": layers, "kv_heads": geo[1], "head_dim": geo[2],
        "dtype_bytes": elsize, "tokens_per_block": geo[0], "num_blocks": shape[0],
        "base": t.data_ptr(), "stride": t.stride()[0] * elsize,
    }
    return layout, backend, device, [t], len(shape) == 2
