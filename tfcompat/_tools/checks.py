"""The comparisons behind ``tfcompat check``: tfcompat against the installed transformers, per family.

Each check returns a dict: family, check, compares ("fwd", "fwd+bwd": outputs and every gradient; "values"),
max_abs_diff, tolerance, passed, skipped (why the check does not apply, else None), seconds, error.
Inputs are tiny random tensors and tiny random-weight configs; nothing is downloaded.
"""

import time

from ..testing import MODEL_RTOL

# fp32: a few ulp of O(1) values; bf16: two ulps (2**-5 each) for |x| < 8
_TOL = {"fp32": 1e-5, "bf16": 2.0 ** -4}


def _result(name, check, fn, tolerance):
    start = time.perf_counter()
    diff, error = float("nan"), None
    try:
        diff = float(fn())
    except Exception as exc:  # a check that cannot run is a failed check, with the reason
        error = f"{type(exc).__name__}: {exc}"
    kind = "bf16" if "bf16" in check else check.split(".")[0] if check.split(".")[0] in _TOL else "fp32"
    tol = tolerance if tolerance is not None else _TOL[kind]
    return {"family": name, "check": check, "max_abs_diff": diff, "tolerance": tol,
            "passed": error is None and diff <= tol, "seconds": round(time.perf_counter() - start, 4),
            "error": error}


def _setup(name, dtype, seed=0, batch=2, seq=23, config=None):
    import torch

    from .._probe import resolve as _resolve
    from ..config import rope_parameters, text_config
    from ..testing import tiny_config

    res = _resolve.resolve("rope.init", name)
    config = tiny_config(name) if config is None else config
    rot = res.target(config=text_config(config))
    g = torch.Generator().manual_seed(seed)
    if _resolve._family(name).vision:
        pos = torch.randint(0, 64, (3, batch, seq), generator=g)
    else:
        pos = torch.randint(0, 64, (batch, seq), generator=g)
    cos, sin = rot(torch.zeros(1, dtype=dtype), pos)
    head_dim = rope_parameters(config).head_dim
    q = torch.randn(batch, 4, seq, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, 2, seq, head_dim, generator=g).to(dtype)
    return config, rot, cos, sin, q, k, g


def _fwd_bwd(fn, q, k, gq, gk):
    import torch

    q = q.detach().clone().requires_grad_(True)
    k = k.detach().clone().requires_grad_(True)
    oq, ok = fn(q * 1, k * 1)
    torch.autograd.backward((oq, ok), (gq, gk))
    return oq.detach(), ok.detach(), q.grad, k.grad


def _rope_vs_upstream(name, dtype, inplace, config=None, device=None, impl="native", vs_cpu=False):
    """apply_rope (``impl``; in place: ``apply_rope_``'s auto) against upstream's own function, forward and
    backward; on ``device`` (inputs drawn on the CPU and moved); ``vs_cpu``: against upstream in fp32 on the CPU."""
    import torch

    from ..rope import apply_rope, apply_rope_

    config, _, cos, sin, q, k, g = _setup(name, dtype, config=config)
    gq, gk = torch.randn(q.shape, generator=g).to(dtype), torch.randn(k.shape, generator=g).to(dtype)
    on = [t.to(device) for t in (cos, sin, q, k, gq, gk)] if device is not None else [cos, sin, q, k, gq, gk]
    if inplace:
        got = _fwd_bwd(lambda a, b: apply_rope_(a, b, on[0], on[1], config=config), *on[2:])
    else:
        got = _fwd_bwd(lambda a, b: apply_rope(a, b, on[0], on[1], config=config, impl=impl), *on[2:])
    if vs_cpu:  # upstream in fp32 on the CPU, from the same (rounded) inputs
        c32, s32 = cos.float(), sin.float()
        want = _fwd_bwd(lambda a, b: apply_rope(a, b, c32, s32, config=config, impl="upstream"),
                        q.float(), k.float(), gq.float(), gk.float())
    else:
        want = _fwd_bwd(lambda a, b: apply_rope(a, b, on[0], on[1], config=config, impl="upstream"), *on[2:])
    return max((w.float().cpu() - h.float().cpu()).abs().max().item() for w, h in zip(want, got))


def _config_vs_rotary(name, config=None):
    import torch

    from ..config import rope_parameters

    config, rot, *_ = _setup(name, torch.float32, config=config)
    rp = rope_parameters(config)
    if rp.rotary_dim != 2 * rot.inv_freq.numel():
        raise AssertionError(f"rotary_dim {rp.rotary_dim} but the rotary module has {rot.inv_freq.numel()} frequencies")
    section = getattr(rot, "mrope_section", None)
    if section is not None and tuple(section) != rp.mrope_section:
        raise AssertionError(f"mrope_section {rp.mrope_section} but the rotary module uses {list(section)}")
    if rp.rope_type != "default":  # scaled frequencies (yarn, dynamic, ...): upstream's init is the oracle
        return 0.0 if rot.inv_freq.numel() * 2 == rp.rotary_dim else float("inf")
    want = 1.0 / (rp.rope_theta ** (torch.arange(0, rp.rotary_dim, 2, dtype=torch.float) / rp.rotary_dim))
    return (rot.inv_freq.float() - want).abs().max().item()


def _forward_kwargs(model, ids, pixels):
    import inspect

    from ..embeds import mm_token_type_ids

    kw = dict(pixels)
    if "mm_token_type_ids" in inspect.signature(type(model).forward).parameters and pixels:
        kw["mm_token_type_ids"] = mm_token_type_ids(model, ids)
    return kw


_BUILT: list = []  # the last (family, config, untouched model): a scaled user model is built once per run


def _model(name, config):
    """A fresh model of ``config`` (None: the family's tiny one): seeded weights, fp32, eval. A scaled user config
    is built (weight init: seconds for the widest) once and deep-copied for every later check of the run."""
    import copy

    import torch

    from ..testing import model_class, tiny_model

    if config is None:
        return tiny_model(name)
    if not (_BUILT and _BUILT[0] == name and _BUILT[1] is config):
        torch.manual_seed(0)
        _BUILT[:] = [name, config, model_class(name)(config).float().eval()]
    return copy.deepcopy(_BUILT[2])


def _padded_reference(name, config=None, model=None, device=None):
    """The unpatched model on a padded batch (two rows, one longer than any window; images for VL families):
    ``(model, mask, reference logits, the loss weights, reference gradients, the packed row, its forward kwargs)``;
    the model's gradients zeroed after. On ``device``: the model and every input moved there, the inputs drawn on
    the CPU as everywhere."""
    import torch

    from .._probe.families import family
    from ..embeds import rope_index
    from ..packing import pack
    from ..testing import padded_batch, tiny_pixels, tiny_sequence

    # a model with its own weights (--model): text rows (the tiny rows' image ids are not its image ids)
    vision = family(name).vision and model is None
    model = _model(name, config) if model is None else model
    if device is not None:
        model = model.to(device)
    window = getattr(getattr(model.config, "get_text_config", lambda: model.config)(), "sliding_window", None)
    longer = 2 * int(window) + 3 if window and int(window) < 16 else 5  # sequences longer than the window
    rows = [tiny_sequence(name, text=longer, image=vision, config=model.config),
            tiny_sequence(name, text=3, image=vision, image_first=True, config=model.config)]
    ids, mask = padded_batch(rows)
    pixels = tiny_pixels(2 if vision else 0)
    if device is not None:
        ids, mask = ids.to(device), mask.to(device)
        pixels = {k: v.to(device) for k, v in pixels.items()}
    ref = model(input_ids=ids, attention_mask=mask, use_cache=False, **_forward_kwargs(model, ids, pixels)).logits
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(0)).to(ref.device)
    (ref * weights * mask[..., None]).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    grid = pixels.get("image_grid_thw")
    pos = rope_index(model, ids, image_grid_thw=grid, attention_mask=mask)[0] if vision else None
    pk = pack(ids, mask, pos, vision=vision)
    return model, mask, ref.detach(), weights, ref_grads, pk, _forward_kwargs(model, pk.input_ids, pixels)


def _difference(logits, ref, mask, grads, ref_grads):
    """The largest difference of the valid logits and of every gradient, each relative to its magnitude (at
    least 1); ``grads``: name -> gradient (None: none)."""
    valid = mask.bool()
    diff = (logits[valid] - ref[valid]).abs().max().item() / max(1.0, ref.abs().max().item())
    for n, grad in grads.items():
        if (grad is None) != (n not in ref_grads):
            # an expert only padding tokens were routed to gets an exact zero gradient in the padded run
            # and none in the packed one; anything else present in one run only is a real difference
            present = grad if grad is not None else ref_grads[n]
            if bool(present.count_nonzero()):
                raise AssertionError(f"{n}: a nonzero gradient in one run only")
            continue
        if grad is not None:
            scale = max(1.0, ref_grads[n].abs().max().item())
            diff = max(diff, (grad - ref_grads[n]).abs().max().item() / scale)
    return diff


def _packed_vs_padded(name, config=None, model=None, device=None):
    """Patched model on a packed batch vs the unpatched model on the padded batch: logits and grads."""
    from .._step import patch as _patch
    from ..packing import unpack

    model, mask, ref, weights, ref_grads, pk, kw = _padded_reference(name, config, model, device)
    _patch.patch(model)
    try:
        out = model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False, **kw).logits
        logits = unpack(out, pk)
        (logits * weights * mask[..., None]).sum().backward()
    finally:
        _patch.unpatch(model)
    return _difference(logits.detach(), ref, mask, {n: p.grad for n, p in model.named_parameters()}, ref_grads)


def _embeds_vs_model(name, images, config=None):
    import torch

    from ..embeds import get_input_embeds
    from ..testing import tiny_pixels, tiny_sequence

    model = _model(name, config)
    ids = torch.tensor([tiny_sequence(name, text=5, image=bool(images), config=model.config)])
    pixels = tiny_pixels(images)
    text = next(m for m in model.modules() if "layers" in m._modules and "embed_tokens" in m._modules)
    seen = {}
    hook = text.register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)
    try:
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
              **_forward_kwargs(model, ids, pixels))
    finally:
        hook.remove()
    res = get_input_embeds(model, ids, **pixels)
    diff = (res.inputs_embeds - seen["inputs_embeds"]).abs().max().item()
    if not images:
        res.inputs_embeds.sum().backward()
        for n, p in model.named_parameters():
            if n.startswith(("visual.", "model.visual.")):
                if p.grad is None:
                    raise AssertionError(f"dummy visual forward left {n} without a gradient")
                diff = max(diff, p.grad.abs().max().item())
    return diff


def _rotary(fam):
    """None where the check applies, else why not (the same reason the refusing API gives)."""
    if fam.nope:
        return "NoPE: the decoder has no rotary embedding; apply_rope and rope_parameters refuse it by name"
    return None


def _vision(fam):
    if not fam.vision:
        return "text-only family"
    return f"tfcompat.embeds refuses it: {fam.embeds_refusal}" if fam.embeds_refusal else None


def _patchable(fam):
    return f"tfcompat.patch refuses it: {fam.patch_refusal}" if fam.patch_refusal else None


#: (check, function, why it does not apply (None: it does), what is compared)
#: (check, function of (family, config, model), why it does not apply (None: it does), what is compared);
#: config: a scaled user config (check --config) or None (the family's tiny config); model: loaded weights
CHECKS = (
    ("config.rope_parameters", lambda n, c, m: _config_vs_rotary(n, c), _rotary, "values"),
    ("rope.native.fp32", lambda n, c, m: _rope_vs_upstream(n, _dtype("float32"), False, c), _rotary, "fwd+bwd"),
    ("rope.inplace.fp32", lambda n, c, m: _rope_vs_upstream(n, _dtype("float32"), True, c), _rotary, "fwd+bwd"),
    ("rope.native.bf16", lambda n, c, m: _rope_vs_upstream(n, _dtype("bfloat16"), False, c), _rotary, "fwd+bwd"),
    ("attention.packed", lambda n, c, m: _packed_vs_padded(n, c, m), _patchable, "fwd+bwd"),
    ("embeds.image", lambda n, c, m: _embeds_vs_model(n, 1, c), _vision, "fwd"),
    ("embeds.dummy", lambda n, c, m: _embeds_vs_model(n, 0, c), _vision, "fwd+bwd"),
)

# relative to the largest magnitude, for whole-model comparisons (fp32 summation order differs): the tests'
# whole-model tolerance (tfcompat.testing.MODEL_RTOL)
_TOL["attention"] = MODEL_RTOL
_TOL["embeds"] = 0.0


def _dtype(name):
    import torch

    return getattr(torch, name)


def run_family(name, tolerance=None, config=None, model=None):
    """Run every check for one family (on ``config`` or ``model`` where given); yields result dicts as they
    finish."""
    from .._probe.families import family

    fam = family(name)
    for check, fn, why_not, what in CHECKS:
        reason = why_not(fam)
        if reason is None and model is not None and check.startswith("embeds."):
            reason = "--model: the checkpoint's own image placeholders need its processor; run --config for them"
        if reason is not None:
            yield {"family": name, "check": check, "compares": what, "max_abs_diff": None, "tolerance": None,
                   "passed": True, "skipped": reason, "seconds": 0.0, "error": None}
            continue
        cfg = model.config if model is not None and not check.startswith("attention.") else config
        result = _result(name, check, lambda fn=fn, cfg=cfg: fn(name, cfg, model), tolerance)
        result.update(compares=what, skipped=None)
        yield result
