"""``tfcompat check --device DEV --dtype T``: every check of ``tfcompat check``, on the user's own device, with the
kernels ``auto`` picks there, against upstream on the same device and against the fp32 CPU reference.

The checks share their code with ``tfcompat check`` (:mod:`.checks`): inputs are drawn on the CPU with the same seeds
and moved to the device. Per family: RoPE by the kernel ``auto`` runs there (forward and backward; out of place and
in place) against upstream's own function on the device, and against upstream in fp32 on the CPU; packed ==
padded logits and gradients on the device (fp32, exact to the whole-model tolerance). Once: the packed-attention
kernel ``report`` names for the device against the exact SDPA path in fp32 on the CPU, forward and backward. Then
speed lines, side by side in one run: the RoPE kernel against upstream and a bandwidth copy. Each GPU kernel also
proves itself on first use (``_kernels.table``); ``plan`` lists what would run, without a device.
"""

import time

from .._probe import backends as _backends
from . import checks as _checks

__all__ = ["plan", "run", "unavailable"]

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# vs the fp32 CPU reference: the dtype's rounding of O(1) values (two ulps at |x| < 8), fp32 a few ulp
_VS_CPU = {"fp32": 1e-5, "bf16": 2.0 ** -4, "fp16": 2.0 ** -7}


def unavailable(device):
    """Why ``device`` cannot run the checks here ('' when it can): one line."""
    import torch

    kind = torch.device(device).type
    if kind == "cpu":
        return ""
    if kind == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            return (f"--device {device}: no CUDA device is visible to torch {torch.__version__} ({build}); run it on "
                    f"the GPU machine, or check the CPU with `tfcompat check`")
        index = torch.device(device).index or 0
        if index >= torch.cuda.device_count():
            return f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible"
        return ""
    return f"--device {device}: tfcompat check runs on cpu or cuda"


def plan(device, dtype):
    """What the run would check on ``device``: (kernel lines, check names per family). Needs no device."""
    import torch

    kind = torch.device(device).type
    rope = _backends.select("rope", kind)
    attn = _backends.select("varlen", kind, _DTYPES[dtype])
    kernels = [f"rope: {rope} ({'proves itself on first use' if rope == 'triton' else 'no GPU kernel'})",
               f"packed attention ({dtype}): {attn}" + (" (proves itself on first use)" if attn != "sdpa" else ""),
               "distributed: " + ("2-process NCCL checks are not run by this command yet: run "
                                  "tests/test_distributed.py on the machine" if kind == "cuda" else "none")]
    for op, name in (("rope", "triton"), ("varlen", "flash_attn"), ("varlen", "torch_varlen")):
        why = _backends.unavailable(op, name)
        if why and kind == "cuda":
            kernels.append(f"not {op}.{name}: {why}")
    checks = [f"rope.{rope}.{dtype}", f"rope.{rope}.{dtype}.inplace", f"rope.{rope}.{dtype}.vs_cpu_fp32",
              "attention.packed.fp32"]
    return kernels, checks, f"varlen.{attn}.{dtype}"


def _rope(name, device, dtype, inplace, vs_cpu):
    import torch

    return _checks._rope_vs_upstream(name, getattr(torch, _DTYPES[dtype]), inplace, device=device, impl="auto",
                                     vs_cpu=vs_cpu)


def _varlen(device, dtype):
    import torch

    from .._attention.kernels import _sdpa_fallback
    from ..varlen import varlen_attention

    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 100, 101, 612, 1000], dtype=torch.int32)
    qkv = [torch.randn(1000, h, 64, generator=g) for h in (8, 2, 2)]
    go = torch.randn(1000, 8, 64, generator=g)
    dt = getattr(torch, _DTYPES[dtype])
    on = [t.to(device=device, dtype=dt).requires_grad_(True) for t in qkv]
    out = varlen_attention(*on, cu.to(device))
    got = (out, *torch.autograd.grad(out, on, go.to(device=device, dtype=dt)))
    ref_in = [t.clone().requires_grad_(True) for t in qkv]
    ref = _sdpa_fallback(*ref_in, cu.tolist(), 64 ** -0.5, True, None, 0.0)
    want = (ref, *torch.autograd.grad(ref, ref_in, go))
    return max((w - h.float().cpu()).abs().max().item() for w, h in zip(want, got))


def run(names, device, dtype, tolerance=None):
    """Yield result dicts (``tfcompat check``'s schema) for ``names`` on ``device`` in ``dtype``."""
    from .._probe.families import family

    _, checks, attention = plan(device, dtype)
    tol_dev = _checks._TOL["bf16"] if dtype != "fp32" else _checks._TOL["fp32"]
    for name in names:
        fam = family(name)
        rotary, patchable = _checks._rotary(fam), _checks._patchable(fam)
        table = [(checks[0], lambda n=name: _rope(n, device, dtype, False, False), rotary, tol_dev, "fwd+bwd"),
                 (checks[1], lambda n=name: _rope(n, device, dtype, True, False), rotary, tol_dev, "fwd+bwd"),
                 (checks[2], lambda n=name: _rope(n, device, dtype, False, True), rotary, _VS_CPU[dtype], "fwd+bwd"),
                 (checks[3], lambda n=name: _fp32_exact(device, _checks._packed_vs_padded, n, device=device),
                  patchable, _checks._TOL["attention"], "fwd+bwd")]
        for i, (check, fn, reason, tol, what) in enumerate(table):
            ran = ("rope", check.split(".")[1]) if i < 3 else ("varlen", attention.split(".")[1])
            yield _one(name, check, fn, reason, tolerance if tolerance is not None else tol, what, ran)
    yield _one("(kernel)", attention, lambda: _varlen(device, dtype), None,
               tolerance if tolerance is not None else _VS_CPU[dtype] * 4, "fwd+bwd",
               ("varlen", attention.split(".")[1]))


def _fp32_exact(on, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with TF32 off on a CUDA device ``on`` (restored after): an fp32 comparison in fp32.
    PyTorch's default lets cuDNN convolutions round their inputs to TF32 (10-bit mantissa), so the vision towers'
    patch-embedding gradients of upstream's own model move by ~1e-4 of their scale when the gradient reaching them
    moves by 1e-7 (measured on an H200, torch 2.11, transformers 5.17: glm_ocr packed vs padded 1.5e-4 with cuDNN
    TF32, 1.0e-6 without; qwen2_5_vl 1.4e-5 and 5.2e-7; the text families 6e-7 either way)."""
    import torch

    if torch.device(on).type != "cuda":
        return fn(*args, **kwargs)
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return fn(*args, **kwargs)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


#: the proven path ``auto`` falls back to, per operation
_FALLBACK = {"rope": "composite", "varlen": "sdpa"}


def _one(name, check, fn, reason, tol, what, planned=None):
    """One check's result. ``planned``: (op, kernel) the plan names the check after. The checks call
    ``impl="auto"``; a planned GPU kernel that fails its first-use proof during the check hands the call to the
    proven path, which then computes the numbers compared: the line names the kernel that ran, and the check
    fails with the proof's reason (a fallback is what the device check exists to find)."""
    if reason is not None:
        return {"family": name, "check": check, "compares": what, "max_abs_diff": None, "tolerance": None,
                "passed": True, "skipped": reason, "seconds": 0.0, "error": None}
    from .._kernels import table

    result = _checks._result(name, check, fn, tol)
    result.update(compares=what, skipped=None)
    # a failed proof of the planned kernel (in this check, or an earlier family's) means it did not run here
    failed = [r for r in table.proven() if not r["ok"] and planned is not None and (r["op"], r["kernel"]) == planned]
    if failed:
        op, kernel = planned
        r = failed[-1]
        why = r["error"] or f"max |diff| {r['max_abs_diff']:.3g} against the proven path"
        parts = check.split(".")
        if parts[1:2] == [kernel]:
            parts[1] = f"{_FALLBACK[op]}(fallback from {kernel})"
        result.update(check=".".join(parts), passed=False,
                      error=f"the {kernel} {op} kernel failed its first-use proof on {r['device']} ({why}); "
                            f"the {_FALLBACK[op]} path ran instead")
    return result


def speed(device, dtype, names, repeats=20):
    """(label, milliseconds) side by side in one run: apply_rope by auto's kernel, upstream's, and a copy of q and
    k (the bandwidth bound), forward, on a Qwen2.5-7B-shaped row (smaller on the CPU), for the first of ``names``
    (else of the installed families) with a plain NeoX rotary (none: an empty list)."""
    import torch

    from .._probe import resolve as _resolve
    from .._probe.families import family
    from ..rope import apply_rope

    def plain(n):
        if family(n).nope:
            return False
        plan = _resolve.resolve("rope.apply", n).plan
        return plan.rotation == "neox" and plan.mrope == "none" and plan.cos_rows == 0
    name = next((n for n in list(names) + _resolve.installed_families() if plain(n)), None)
    if name is None:
        return []

    dt = getattr(torch, _DTYPES[dtype])
    cuda = torch.device(device).type == "cuda"
    seq, hq, hk, dim = (16384, 28, 4, 128) if cuda else (2048, 8, 2, 64)
    q = torch.randn(1, seq, hq, dim, device=device, dtype=dt)
    k = torch.randn(1, seq, hk, dim, device=device, dtype=dt)
    pos = torch.arange(seq, device=device, dtype=torch.float32)
    freqs = pos[:, None] / 10000 ** (torch.arange(0, dim, 2, device=device) / dim)[None]
    emb = torch.cat((freqs, freqs), -1)[None]
    cos, sin = emb.cos().to(dt), emb.sin().to(dt)
    runs = {f"rope {_backends.select('rope', device)}": lambda: apply_rope(q, k, cos, sin, model_type=name,
                                                                          unsqueeze_dim=2),
            "rope upstream": lambda: apply_rope(q, k, cos, sin, model_type=name, unsqueeze_dim=2, impl="upstream"),
            "copy q, k": lambda: (q.clone(), k.clone())}
    out = []
    for label, fn in runs.items():
        fn()  # warm-up (and the first-use proof)
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
        out.append((label, (time.perf_counter() - start) * 1e3 / repeats))
    return out


def refusal(device):
    """Why ``--device`` names no device tfcompat check runs on ('' when it names cpu or cuda[:N]): one line for
    a string torch does not parse (``gpu``, ``CPU``, ``cuda:abc``) and for devices torch knows but the check does
    not run on (mps, xpu, meta), in the plan and in the run alike."""
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError, TypeError):
        kind = None
    if kind in ("cpu", "cuda") and device == device.strip():
        return ""
    return (f"--device {device!r}: tfcompat check runs on cpu or cuda (cuda:N for one GPU of several); "
            f"{'torch does not know this device string' if kind is None else kind + ' is not one of them'}")
