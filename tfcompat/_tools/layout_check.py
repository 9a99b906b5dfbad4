"""``tfcompat check --config PATH --ulysses N --context M``: the packed step of the scaled model over N x M spawned
gloo ranks (Ulysses over N, context parallelism over M, both on one ``DeviceMesh``) against the single-process
unpatched model on the padded batch: gathered logits and every gradient summed over the ranks.

The ranks rendezvous through a file in a temporary folder (no port) and each writes its outcome there; a rank
that does not finish in time is killed and the check fails saying so (never a hang).
"""

import time

from ..errors import ConfigError


def layouts(fam, config):
    """The sequence-parallel degrees the model's real head counts allow (what ``tfcompat.patch`` accepts):
    Ulysses degrees divide the query heads (kv heads are repeated where the degree does not divide them);
    context parallelism takes any degree; linear-attention layers take neither."""
    from .._probe import resolve as _resolve
    from .._probe.drift import text_config

    text = text_config(config)
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    if _resolve.resolve("attention.signature", fam.name).plan.linear_attention:
        why = "linear-attention (Gated DeltaNet) layers carry a recurrent state along the sequence"
        return {"ulysses": [1], "kv_repeated": [], "context": False, "query_heads": heads, "kv_heads": kv,
                "line": f"no sequence parallelism: {why} (tfcompat.patch refuses ulysses_group and context_group)"}
    degrees = [d for d in range(1, heads + 1) if heads % d == 0]
    repeated = [d for d in degrees if kv % d]
    line = f"Ulysses degrees {', '.join(map(str, degrees))} ({heads} query heads"
    line += f"; {kv} kv heads repeated for {', '.join(map(str, repeated))})" if repeated else f", {kv} kv heads)"
    return {"ulysses": degrees, "kv_repeated": repeated, "context": True, "query_heads": heads, "kv_heads": kv,
            "line": line + "; context parallel: any degree, also beside Ulysses"}


#: what one spawned rank of the scaled model's layout check holds (torch, transformers, the tiny model, gloo):
#: measured 0.31 GiB a rank at 64 ranks of Qwen3-0.6B on the 2-core, 24 GiB machine (20 GiB peak), with margin
_RANK_GIB = 0.5
#: spawned ranks per core past which the check's collectives crawl (64 ranks on 2 cores: 5 min 48 s idle)
_RANKS_PER_CORE = 4


def machine():
    """(cores, GiB of memory available): what the layout check's ranks share."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/proc/meminfo") as fh:
            info = {line.split(":")[0]: int(line.split()[1]) for line in fh if line.split()[1:2]}
        gib = info.get("MemAvailable", info.get("MemTotal", 0)) / 2 ** 20
    except (OSError, ValueError, IndexError):
        gib = 8.0  # unknown: a small machine
    return cores, gib


def rank_limit(ulysses, context, machine):
    """Why a layout of ``ulysses * context`` spawned ranks does not fit ``machine`` = (cores, GiB available)
    ('' when it fits). Pure: the numbers decide, tested without spawning anything."""
    cores, gib = machine
    ranks = ulysses * context
    fits = max(2, min(int(gib // _RANK_GIB), cores * _RANKS_PER_CORE))
    if ranks <= fits:
        return ""
    hint = ""
    for u in sorted({d for d in (ulysses, 4, 2, 1) if d <= min(ulysses, fits)}, reverse=True):
        c = min(context, fits // u)
        if u * c > 1:
            hint = f"; the same code paths run in a smaller layout: --ulysses {u} --context {c}"
            break
    return (f"Ulysses {ulysses} x context {context} would start {ranks} processes, and this machine ({cores} "
            f"cores, {gib:.1f} GiB available) holds at most {fits} (about {_RANK_GIB} GiB and 1/{_RANKS_PER_CORE} "
            f"core each){hint}")


def refusal(allowed, ulysses):
    """Why the real model cannot run Ulysses over ``ulysses`` ranks beside context parallelism (None: it can): the
    facts ``tfcompat.patch`` refuses on (``allowed``: :func:`layouts`)."""
    if not allowed["context"]:
        return allowed["line"]
    if ulysses not in allowed["ulysses"]:
        return (f"Ulysses over {ulysses} ranks splits the attention heads, and {ulysses} does not divide the "
                f"{allowed['query_heads']} query heads (Ulysses degrees {', '.join(map(str, allowed['ulysses']))}; "
                f"context parallelism takes any degree)")
    return None


def _groups(ulysses, context):
    import torch.distributed as dist

    if ulysses > 1 and context > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (context, ulysses), mesh_dim_names=("cp", "sp"))
        return {"group": mesh["sp"].get_group(), "context_group": mesh["cp"].get_group()}
    if ulysses > 1:
        return {"group": dist.group.WORLD}
    return {"context_group": dist.group.WORLD}


def _rank_step(name, config, ulysses, context):
    """One rank: the reference (every rank builds it: the same seed, the same numbers), then the patched model on
    this rank's share of the packed row; the largest relative difference (logits; gradients summed over ranks)."""
    import torch.distributed as dist

    from .._probe.families import family
    from .._step import patch as _patch
    from ..packing import unpack
    from ..ulysses import gather_from_ranks, slice_for_rank
    from .checks import _difference, _model, _padded_reference

    _, mask, ref, weights, ref_grads, pk, kw = _padded_reference(name, config)
    groups = _groups(ulysses, context)
    vision = family(name).vision
    model = _model(name, config).train()
    _patch.patch(model, ulysses_group=groups.get("group"), context_group=groups.get("context_group"),
                 slice_inputs=vision)
    if vision:  # the whole row on every rank (images are embedded whole); the model keeps its share
        local = model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False, **kw).logits
    else:
        dim = pk.position_ids.dim() - 1
        local = model(input_ids=slice_for_rank(pk.input_ids, dim=1, **groups),
                      position_ids=slice_for_rank(pk.position_ids, dim=dim, **groups), use_cache=False).logits
    logits = unpack(gather_from_ranks(local, dim=1, length=pk.input_ids.shape[1], **groups), pk)
    (logits * weights * mask[..., None]).sum().backward()
    grads = {}
    for n, p in model.named_parameters():  # summed over the ranks (a rank without one contributes zeros)
        grads[n] = p.grad.clone() if p.grad is not None else p.new_zeros(p.shape)
        dist.all_reduce(grads[n])
    return _difference(logits.detach(), ref, mask, grads, ref_grads)


def _rank(rank, world, name, config, ulysses, context):
    return _rank_step(name, config, ulysses, context)


def run(name, config, ulysses, context, tolerance=None, timeout=600.0):
    """The check's result dict (as :mod:`.checks` makes them) of the packed step over ``ulysses x context``
    spawned gloo ranks."""

    from ..testing import MODEL_RTOL, spawn_ranks

    world = ulysses * context
    if world < 2:
        raise ConfigError("tfcompat check: --ulysses N and --context M run over N x M ranks: at least 2")
    check = f"layout.ulysses{ulysses}.context{context}"
    tol = tolerance if tolerance is not None else MODEL_RTOL
    start = time.perf_counter()
    outcomes = spawn_ranks(_rank, world, name, config, ulysses, context, timeout=timeout, init_timeout=120)
    errors = [f"rank {o['rank']}: {o['error']}" for o in outcomes if "error" in o]
    diff = max((o["result"] for o in outcomes if "result" in o), default=float("nan"))
    return {"family": name, "check": check, "compares": "fwd+bwd", "max_abs_diff": diff, "tolerance": tol,
            "passed": not errors and diff <= tol, "skipped": None,
            "seconds": round(time.perf_counter() - start, 4), "error": "; ".join(errors[:2]) or None}
