"""The transformers tier's checks: the versions and signatures it hooks,
the model configurations it refuses, and the namespaces it keys by."""

import inspect
import itertools
import logging
import os
import uuid

from ..errors import KvoError

logger = logging.getLogger("kvoffload.transformers")


# transformers (major, minor) versions whose continuous-batching internals
# this module hooks, checked on a GPU (bench/transformers_cb.py).
SUPPORTED_VERSIONS = ((5, 17),)
UNTESTED_ENV = "KVOFFLOAD_TF_UNTESTED"

# The methods the hooks wrap or call, with the parameter names of 5.17
# (after self). attach() checks them against the installed transformers.
HOOKED_SIGNATURES = {
    "BlockManager.has_enough_free_blocks": ("n_blocks",),
    "BlockManager.get_free_blocks": ("n_blocks", "last_block_id", "shareable", "group_id"),
    "BlockManager.mark_shareable_blocks_as_complete": ("num_complete_blocks", "allocated_blocks", "prompt_ids"),
    "BlockManager.compute_hash": ("parent_hash", "tokens", "group_id"),
    "BlockManager.uninitialize_unshared_block": ("block_id",),
    "PagedAttentionCache.search_prefix_match": ("request_id", "prompt_ids"),
    "PagedAttentionCache.update": ("key_states", "value_states", "layer_idx", "read_index", "write_index"),
    "Scheduler._infer_request_tokens": ("state", "request_ids_to_remove_from_waiting"),
    "OffloadingManager._offload_to_cpu": ("victims",),
    "ContinuousBatchingManager._create_batch_processor": (),
    "ContinuousMixin.init_continuous_batching": ("generation_config", "continuous_batching_config",
                                                 "workload_hints"),
}


class TransformersIntegrationError(KvoError):
    """Base of the errors of this integration."""


class UnsupportedVersionError(TransformersIntegrationError, RuntimeError):
    """The installed transformers is not a supported version, or a method
    the hooks need has another signature."""


class UnsupportedModelError(TransformersIntegrationError, ValueError):
    """The model's cache layout is not supported (sliding-window or other
    non-full-attention layers, tensor parallelism)."""


class UnsupportedConfigError(TransformersIntegrationError, ValueError):
    """The continuous batching configuration conflicts with the tier
    (transformers' own CPU swap pool on, block sharing off)."""


# ---- versions and signatures ----------------------------------------------

def parse_version(version):
    """(major, minor) of a version string such as "5.17.0" or "5.17.0.dev0"."""
    parts = str(version).split(".")
    try:
        return int(parts[0]), int("".join(itertools.takewhile(str.isdigit, parts[1])) or "x")
    except (IndexError, ValueError):
        raise UnsupportedVersionError(f"kvoffload: cannot read the transformers version {version!r}") from None


def check_version(version, env=None):
    """Raises UnsupportedVersionError unless version is a supported
    transformers version; with KVOFFLOAD_TF_UNTESTED=1 in env (default
    os.environ) an unsupported one only warns. Returns (major, minor)."""
    env = os.environ if env is None else env
    mm = parse_version(version)
    if mm in SUPPORTED_VERSIONS:
        return mm
    supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VERSIONS)
    msg = (f"kvoffload.integrations.transformers supports transformers {supported} (it hooks continuous batching's "
           f"BlockManager, PagedAttentionCache, Scheduler and OffloadingManager, whose internals change between "
           f"releases); transformers {version} is installed")
    if env.get(UNTESTED_ENV) == "1":
        logger.warning("%s; going on because %s=1", msg, UNTESTED_ENV)
        return mm
    raise UnsupportedVersionError(f"{msg}. Install transformers=={SUPPORTED_VERSIONS[-1][0]}."
                                  f"{SUPPORTED_VERSIONS[-1][1]}.*, or set {UNTESTED_ENV}=1 to try it anyway.")


def check_signatures(classes):
    """classes: {"BlockManager": cls, ...}. Raises UnsupportedVersionError
    naming every hooked method that is missing or whose parameters differ
    from HOOKED_SIGNATURES."""
    bad = []
    for qual, want in HOOKED_SIGNATURES.items():
        cname, meth = qual.split(".")
        cls = classes.get(cname)
        fn = getattr(cls, meth, None) if cls is not None else None
        if fn is None:
            bad.append(f"{qual} is missing")
            continue
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            bad.append(f"{qual}: no signature")
            continue
        got = tuple(p for p in params[1:] if p not in ("args", "kwargs"))
        if got != tuple(want):
            bad.append(f"{qual}{tuple(params[1:])}, want {tuple(want)}")
    if bad:
        raise UnsupportedVersionError("kvoffload: transformers' continuous batching is not the one this integration "
                                      "hooks: " + "; ".join(bad))


def transformers_classes():
    """The installed transformers' classes the hooks touch (imports it)."""
    from transformers.generation.continuous_batching import cache_manager, continuous_api, offloading_manager
    from transformers.generation.continuous_batching import cache as cache_mod
    from transformers.generation.continuous_batching import scheduler as sched_mod
    return {
        "BlockManager": cache_manager.BlockManager,
        "PagedAttentionCache": cache_mod.PagedAttentionCache,
        "Scheduler": sched_mod.Scheduler,
        "OffloadingManager": offloading_manager.OffloadingManager,
        "ContinuousBatchingManager": continuous_api.ContinuousBatchingManager,
        "ContinuousMixin": continuous_api.ContinuousMixin,
    }


def check_transformers(env=None):
    """Checks the installed transformers (version and hooked signatures);
    returns its version string."""
    import transformers
    check_version(transformers.__version__, env=env)
    check_signatures(transformers_classes())
    return transformers.__version__


# ---- layer groups and namespaces ------------------------------------------

def layer_groups(config):
    """The layer groups transformers 5.17 makes (group_layers_by_attn_type):
    (groups as lists of layer indices, their attention types)."""
    from math import gcd
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        t = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
        layer_types = [t] * config.num_hidden_layers
    by_type = {}
    for i, t in enumerate(layer_types):
        by_type.setdefault(t, []).append(i)
    size = gcd(*[len(v) for v in by_type.values()])
    groups = []
    for idx in by_type.values():
        for i in range(0, len(idx), size):
            groups.append(idx[i:i + size])
    return groups, [layer_types[g[0]] for g in groups]


def check_model_config(config):
    """Raises UnsupportedModelError for a model with any layer that is not
    full attention (sliding window, chunked, ...)."""
    groups, types = layer_groups(config)
    other = sorted({t for t in types if t != "full_attention"})
    if other:
        layers = [l for g, t in zip(groups, types) if t != "full_attention" for l in g]
        raise UnsupportedModelError(
            f"kvoffload: this model has {', '.join(other)} layers ({len(layers)} of "
            f"{sum(len(g) for g in groups)}: {layers[:8]}{'...' if len(layers) > 8 else ''}), in {len(groups)} layer "
            "groups: the transformers tier supports models whose layers are all full attention. transformers "
            "itself turns prefix sharing off for such models, and a sliding-window group's blocks are a rolling "
            "buffer that no token prefix names, so they can be neither shared nor resumed by key.")
    return groups, types


def check_no_cuda_graphs(use_cuda_graph):
    """Raises UnsupportedConfigError when transformers' CUDA graphs are on
    (True, or a tuple with any True; None, transformers' automatic choice,
    is checked again on the batch processor, where it is resolved). A
    replayed graph reads the cache without the per-layer waits and
    orders its kernels by the graph, not by the stream waits the tier puts
    on the compute stream before a load's blocks are read; that ordering
    is not checked on a GPU, so the tier refuses rather than risk a read
    of a block still being copied."""
    on = any(bool(x) for x in use_cuda_graph) if isinstance(use_cuda_graph, (tuple, list)) else use_cuda_graph is True
    if on:
        raise UnsupportedConfigError(
            f"kvoffload: use_cuda_graph={use_cuda_graph!r}: the transformers tier does not support transformers' "
            "CUDA graphs; set ContinuousBatchingConfig(use_cuda_graph=False)")


def model_namespace(model_id, dtype, block_size, kv_heads, head_dim, layers):
    """The engine namespace of a model's KV blocks: everything the bytes of
    a block depend on besides its tokens."""
    dt = str(dtype).replace("torch.", "")
    return f"transformers-cb/{model_id}/{dt}/bs{block_size}/kv{kv_heads}x{head_dim}/L{layers}"


def group_namespace(namespace, group):
    """The namespace of layer group group's blocks: keys of two groups over
    the same tokens differ."""
    return f"{namespace}/g{int(group)}"


def default_model_id(model):
    """The model's name or path (with its commit hash when known); for a
    model built from a config (no name), a process-local id, with a
    warning: its blocks are then never shared with another process."""
    cfg = getattr(model, "config", None)
    name = getattr(cfg, "_name_or_path", "") or ""
    if name:
        commit = getattr(cfg, "_commit_hash", None)
        return f"{name}@{commit}" if commit else name
    mid = f"unnamed-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    logger.warning("kvoffload: the model has no name (built from a config?): its blocks get the process-local "
                   "model id %s; pass model_id= to attach() to name its weights", mid)
    return mid


# ---- the tier -------------------------------------------------------------
