"""Block keys, computed in pure Python (hashlib) exactly as Go's
kvcache.ChainKeys (and offload.ChainKeys) do:

    key(block i) = SHA-256(key(block i-1) || tokens of block i as
                           little-endian uint32 || namespace)[:16]

with key(block -1) = the parent (16 zero bytes when the tokens start a
sequence). A partial trailing block gets no key. The committed vectors in
kvcache/testdata/key_vectors.json pin both implementations."""

import hashlib
import struct

from .errors import ArgumentTypeError, InvalidArgumentError

KEY_BYTES = 16
ZERO_KEY = bytes(KEY_BYTES)
_MAX_TOKEN = 0xFFFFFFFF


def _namespace_bytes(namespace):
    if namespace is None:
        return b""
    if isinstance(namespace, str):
        return namespace.encode("utf-8")
    if isinstance(namespace, (bytes, bytearray, memoryview)):
        return bytes(namespace)
    raise InvalidArgumentError(f"namespace must be str or bytes, got {type(namespace).__name__}")


def _parent_bytes(parent):
    if parent is None:
        return ZERO_KEY
    parent = bytes(parent)
    if len(parent) != KEY_BYTES:
        raise InvalidArgumentError(f"parent key is {len(parent)} bytes, must be {KEY_BYTES}")
    return parent


def block_key(tokens, namespace=b"", parent=None):
    """The key of one block of token ids (any length), chained to parent."""
    parent = _parent_bytes(parent)
    ns = _namespace_bytes(namespace)
    return _block_key(list(tokens), ns, parent)


def _pack_tokens(tokens, block=None):
    """tokens (a list) as little-endian uint32 bytes; raises for a token that
    is not an int in [0, 2^32) (struct would take a bool as 0 or 1), the
    error of the first bad block of block tokens (see _token_error)."""
    try:
        packed = struct.pack("<%dI" % len(tokens), *tokens)
        bad = bool in set(map(type, tokens))
    except struct.error:
        bad = True
    if bad:
        raise _token_error(tokens, block)
    return packed


def _token_error(tokens, block=None):
    """The error of the first block (block tokens each; None: one block)
    holding a bad token: within it, a token of another type before one out
    of range, as a block at a time always reported."""
    block = block or max(len(tokens), 1)
    for start in range(0, len(tokens), block):
        chunk = tokens[start:start + block]
        t = next((t for t in chunk if isinstance(t, bool) or not isinstance(t, int)), None)
        if t is not None:
            return ArgumentTypeError(f"token id {t!r} is a {type(t).__name__}, must be an integer in [0, {_MAX_TOKEN}]")
        t = next((t for t in chunk if not 0 <= t <= _MAX_TOKEN), None)
        if t is not None:
            return InvalidArgumentError(f"token id {t!r} is outside [0, {_MAX_TOKEN}]")
    return InvalidArgumentError("token ids could not be packed as uint32")


def _block_key(tokens, ns, parent):
    return hashlib.sha256(parent + _pack_tokens(tokens) + ns).digest()[:KEY_BYTES]


def chain_keys(tokens, tokens_per_block, namespace=b"", parent=None):
    """The keys of the full blocks of tokens (a sequence of ints, or a 1-D
    tensor/array with .tolist()), each chained to the one before. namespace
    (str or bytes) must be the engine's; parent continues an earlier chain."""
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int) or tokens_per_block < 1:
        raise InvalidArgumentError(f"tokens_per_block = {tokens_per_block!r}, must be an integer >= 1")
    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()
    tokens = list(tokens)
    ns = _namespace_bytes(namespace)
    key = _parent_bytes(parent)
    full = len(tokens) // tokens_per_block * tokens_per_block
    packed = _pack_tokens(tokens[:full], tokens_per_block)  # the whole chain at once: one pass of checks
    step = 4 * tokens_per_block
    keys = []
    sha = hashlib.sha256
    for start in range(0, 4 * full, step):
        key = sha(key + packed[start:start + step] + ns).digest()[:KEY_BYTES]
        keys.append(key)
    return keys


def pack_keys(keys):
    """Checks keys (an iterable of 16-byte bytes-like objects, or one
    bytes-like object of 16*n bytes) and returns (packed bytes, n)."""
    if isinstance(keys, (bytes, bytearray, memoryview)):
        raw = bytes(keys)
        if len(raw) % KEY_BYTES:
            raise InvalidArgumentError(f"packed keys are {len(raw)} bytes, not a multiple of {KEY_BYTES}")
        return raw, len(raw) // KEY_BYTES
    if isinstance(keys, str):
        raise ArgumentTypeError(f"keys must be {KEY_BYTES}-byte keys or packed bytes, got a str")
    if type(keys) is list and keys:
        # The common case at C speed (a list of bytes, as chain_keys gives):
        # joined (a non-bytes-like key raises), then every key's length and
        # the total checked: about half the time of checking each key's
        # type and length first (0.04 ms for 2048 keys on this project's
        # CPU machine). Anything else, or any bad key, takes the loop below,
        # which names the key.
        try:
            raw = b"".join(keys)
        except TypeError:
            raw = None
        n = len(keys)
        if raw is not None and len(raw) == KEY_BYTES * n and list(map(len, keys)).count(KEY_BYTES) == n:
            return raw, n
    try:
        it = iter(keys)
    except TypeError:
        raise ArgumentTypeError(f"keys must be an iterable of {KEY_BYTES}-byte keys or packed bytes, "
                                f"got {type(keys).__name__}") from None
    parts = []
    for i, k in enumerate(it):
        if not isinstance(k, (bytes, bytearray, memoryview)):
            raise ArgumentTypeError(f"key {i} is a {type(k).__name__}, must be {KEY_BYTES} bytes")
        k = bytes(k)
        if len(k) != KEY_BYTES:
            raise InvalidArgumentError(f"key {i} is {len(k)} bytes, must be {KEY_BYTES}")
        parts.append(k)
    return b"".join(parts), len(parts)
