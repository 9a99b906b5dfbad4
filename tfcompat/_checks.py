"""The comparisons behind ``tfcompat check``: tfcompat against the installed transformers, per family.

Each check returns a dict: family, check, max_abs_diff, tolerance, passed, seconds, error.
Inputs are tiny random tensors and tiny random-weight configs; nothing is downloaded.
"""

import time

# fp32: a few ulp of O(1) values; bf16: two ulps (2**-5 each) for |x| < 8
_TOL = {"fp32": 1e-5, "bf16": 2.0 ** -4}


def _result(name, check, fn, tolerance):
    start = time.perf_counter()
    diff, error = float("nan"), None
    try:
        diff = float(fn())
    except Exception as exc:  # a check that cannot run is a failed check, with the reason
        error = f"{type(exc).__name__}: {exc}"
    tol = tolerance if tolerance is not None else _TOL["bf16" if "bf16" in check else "fp32"]
    return {"family": name, "check": check, "max_abs_diff": diff, "tolerance": tol,
            "passed": error is None and diff <= tol, "seconds": round(time.perf_counter() - start, 4),
            "error": error}


def _setup(name, dtype, seed=0, batch=2, seq=23):
    import torch

    from . import _resolve
    from .config import rope_parameters, text_config
    from .testing import tiny_config

    res = _resolve.resolve("rope.init", name)
    config = tiny_config(name)
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


def _rope_vs_upstream(name, dtype, inplace):
    import torch

    from .rope import apply_rope, apply_rope_

    config, _, cos, sin, q, k, g = _setup(name, dtype)
    gq, gk = torch.randn(q.shape, generator=g).to(dtype), torch.randn(k.shape, generator=g).to(dtype)
    want = _fwd_bwd(lambda a, b: apply_rope(a, b, cos, sin, config=config, impl="upstream"), q, k, gq, gk)
    if inplace:
        got = _fwd_bwd(lambda a, b: apply_rope_(a, b, cos, sin, config=config), q, k, gq, gk)
    else:
        got = _fwd_bwd(lambda a, b: apply_rope(a, b, cos, sin, config=config, impl="native"), q, k, gq, gk)
    return max((w.float() - h.float()).abs().max().item() for w, h in zip(want, got))


def _config_vs_rotary(name):
    import torch

    from .config import rope_parameters

    config, rot, *_ = _setup(name, torch.float32)
    rp = rope_parameters(config)
    if rp.rotary_dim != 2 * rot.inv_freq.numel():
        raise AssertionError(f"rotary_dim {rp.rotary_dim} but the rotary module has {rot.inv_freq.numel()} frequencies")
    section = getattr(rot, "mrope_section", None)
    if section is not None and tuple(section) != rp.mrope_section:
        raise AssertionError(f"mrope_section {rp.mrope_section} but the rotary module uses {list(section)}")
    want = 1.0 / (rp.rope_theta ** (torch.arange(0, rp.rotary_dim, 2, dtype=torch.float) / rp.rotary_dim))
    return (rot.inv_freq.float() - want).abs().max().item()


CHECKS = (
    ("config.rope_parameters", lambda n: _config_vs_rotary(n)),
    ("rope.native.fp32", lambda n: _rope_vs_upstream(n, _dtype("float32"), inplace=False)),
    ("rope.inplace.fp32", lambda n: _rope_vs_upstream(n, _dtype("float32"), inplace=True)),
    ("rope.native.bf16", lambda n: _rope_vs_upstream(n, _dtype("bfloat16"), inplace=False)),
)


def _dtype(name):
    import torch

    return getattr(torch, name)


def run_family(name, tolerance=None):
    """Run every check for one family; yields result dicts as they finish."""
    for check, fn in CHECKS:
        yield _result(name, check, lambda: fn(name), tolerance)
