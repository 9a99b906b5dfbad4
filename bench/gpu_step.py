"""A 7B-shaped packed training step and the RoPE kernel on one GPU, measured side by side in one run (<= 8 minutes).

    python bench/gpu_step.py                          # CUDA: the tables docs/gpu.md records
    python bench/gpu_step.py --device cpu --tiny      # a dry run of every path on small shapes (no timing claims)

1. **The step**: forward + backward in bf16 of a text stack shaped like Qwen2.5-VL-7B (hidden 3584, 28 heads, 4 kv
   heads, head_dim 128, MLP 18944, mRoPE sections 16/24/24) and like Qwen3-8B (hidden 4096, 32 heads, 8 kv heads,
   MLP 12288, q/k norms), ``--layers`` decoder layers (default 2), random weights, a small vocabulary (the LM head
   is not what packing changes), over packed rows of mixed lengths at 16k and 64k tokens. Paths, each against the
   same tokens: the unpatched model on the padded batch (``attention_mask``); upstream's own packed path (the
   unpatched model on one row of packed position ids: transformers 5.x reads them as sequence boundaries, SDPA
   through a block mask and ``flash_attention_2`` where flash-attn imports; 4.x does not, so its row is marked
   inexact); the patched model with each packed-attention kernel this machine can choose (flash-attn, torch's
   ``varlen_attn``, SDPA per sequence), eager and whole-model compiled (upstream's attention forward and rotary,
   tfcompat serving the attention call); and, where the fused Triton RoPE runs, the model patched under
   ``TFCOMPAT_ROPE_IMPL=triton`` (tfcompat's bundled attention forward with that kernel). Printed: tokens/s (real
   tokens), peak memory, the loss against the padded batch's, and the ratios the targets name (patched / unpatched
   padded, patched / upstream packed SDPA).
2. **RoPE**: a copy of q and k (the limit: RoPE moves ``4 T (Hq + Hk) D`` bytes), tfcompat's kernel (Triton where
   it runs, else its composite), upstream's rotary function, Liger-Kernel's (where ``liger_kernel`` imports), forward
   and forward + backward, at the two models' shapes, 16k and 64k tokens; ratios against the copy.

Timing: CUDA events around ``--repeats`` calls after ``--warmup`` (the compiled paths compile in the warmup); the
lower quartile of interleaved rounds. On the CPU (``--device cpu --tiny``) every path runs once on small shapes and
the numbers mean nothing: the matrix runs it so the script never rots. Exits 1 when a path that should equal the
padded batch does not (loss beyond ``--tol``).
"""

import argparse
import copy
import os
import statistics
import sys
import time

import torch

import tfcompat
from tfcompat.packing import pack

#: the text stacks (transformers' own config keys), as their published configs give them
SHAPES = {
    "qwen2_5_vl-7b": ("qwen2_5_vl", dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                                         head_dim=128, intermediate_size=18944), (16, 24, 24)),
    "qwen3-8b": ("qwen3", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                               intermediate_size=12288), None),
}
TINY = ({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "intermediate_size": 128}, (2, 3, 3))


def _lengths(total, seed):
    """Mixed sequence lengths summing to ``total`` (an SFT / RL batch: a few long, many short)."""
    g = torch.Generator().manual_seed(seed)
    out, left = [], total
    while left > 0:
        n = int(min(left, max(16, torch.empty(1).exponential_(generator=g).item() * total / 8)))
        out.append(n)
        left -= n
    return out


def _model(name, layers, device, dtype, tiny):
    """The text stack of ``name`` (its widths, heads, mRoPE sections), random weights, a small vocabulary."""
    from tfcompat.testing import model_class, tiny_config

    family, shape, section = SHAPES[name]
    if tiny:
        shape, section = TINY[0], (TINY[1] if section else None)
    config = tiny_config(family, num_hidden_layers=layers, vocab_size=512 if tiny else 4096, **shape)
    text = config.get_text_config()
    for key in ("rope_parameters", "rope_scaling"):  # where this release keeps the sections (5.x / 4.x)
        rope = getattr(text, key, None)
        if section and isinstance(rope, dict) and "mrope_section" in rope:
            rope["mrope_section"] = list(section)
    torch.manual_seed(0)
    return model_class(family)(config).to(device=device, dtype=dtype).train()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, warmup, repeats):
    """(lower-quartile seconds, peak bytes or None)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    low = statistics.quantiles(times, n=4)[0] if len(times) > 1 else times[0]
    return low, peak


def _loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=-100)


def _step_rows(name, args, device, dtype, tokens):
    lengths = _lengths(tokens, seed=tokens)
    width = max(lengths)
    g = torch.Generator().manual_seed(1)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(5, 500, (n,), generator=g)
        mask[i, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    pk = pack(ids, mask, vision=False)
    ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
    row = dict(input_ids=pk.input_ids.to(device), position_ids=pk.position_ids.to(device))
    row_labels = pk.input_ids.to(device).masked_fill(pk.position_ids.to(device) == 0, -100)  # no first-token target
    padded_labels = labels.clone()
    padded_labels[:, 0] = -100
    base = _model(name, args.layers, device, dtype, args.tiny)
    results, reference = [], None

    def run(label, model, call, target, compiled=False, exact=True):
        nonlocal reference
        fwd = torch.compile(model, backend=args.backend) if compiled else model

        def step():
            out = fwd(**call, use_cache=False)
            loss = _loss(out.logits[..., :-1, :], target[..., 1:])
            loss.backward()
            model.zero_grad(set_to_none=True)
            return loss

        try:
            seconds, peak = _timed(step, device, args.warmup, args.repeats)
            with torch.no_grad():
                loss = _loss(fwd(**call, use_cache=False).logits[..., :-1, :], target[..., 1:]).item()
        except Exception as exc:  # a path this machine cannot run: said, not fatal
            results.append((label, None, None, None, f"{type(exc).__name__}: {str(exc)[:80]}"))
            return
        if reference is None:
            reference = loss
        off = abs(loss - reference) / max(abs(reference), 1e-6)
        results.append((label, tokens / seconds, peak, loss, "" if off <= args.tol else
                        f"not the padded batch's loss here ({off:.1e} relative)"))
        if exact and off > args.tol:
            FAILURES.append(f"{name} {tokens}: {label} loss {loss:.5f} vs padded {reference:.5f}")

    run("unpatched, padded batch (sdpa)", base, dict(input_ids=ids, attention_mask=mask), padded_labels)
    # upstream's packed rows are what they are on this release (a VL family's 2-D ids, or 4.x): measured, not held
    run("upstream packed row (sdpa)", base, row, row_labels, exact=False)
    if _flash_importable() and device.type == "cuda":
        fa = copy.deepcopy(base)
        fa.set_attn_implementation("flash_attention_2")
        run("upstream packed row (flash_attention_2)", fa, row, row_labels, exact=False)
        del fa
    patched = copy.deepcopy(base)
    tfcompat.patch(patched)
    for kernel in _kernels(device, dtype):
        with _forced(kernel):
            run(f"patched ({kernel})", patched, row, row_labels)
            run(f"patched ({kernel}), compiled", patched, row, row_labels, compiled=True)
    del patched
    from tfcompat.rope import impl_for

    if impl_for(device) == "triton":  # the bundled forward with tfcompat's fused RoPE (chosen when patch runs)
        bundled = copy.deepcopy(base)
        saved = os.environ.get("TFCOMPAT_ROPE_IMPL")
        os.environ["TFCOMPAT_ROPE_IMPL"] = "triton"
        try:
            tfcompat.patch(bundled)
            run("patched (sdpa), bundled forward + Triton RoPE", bundled, row, row_labels)
        finally:
            if saved is None:
                del os.environ["TFCOMPAT_ROPE_IMPL"]
            else:
                os.environ["TFCOMPAT_ROPE_IMPL"] = saved
        del bundled
    return results


def _flash_importable():
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return True


def _kernels(device, dtype):
    """The packed-attention kernels the patched model can choose on ``device`` (SDPA per sequence always)."""
    from tfcompat._attention import kernel_choice  # private: the bench forces each kernel in turn

    out = ["sdpa"]
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        out += [name for name, why in kernel_choice.varlen_unfit().items() if not why]
    return out


class _forced:
    """``with _forced("flash_attn"):`` the patched model's packed attention uses that kernel (proven on first use)."""

    def __init__(self, kernel):
        from tfcompat._attention import kernel_choice  # private: the choice the bench overrides

        self.module, self.kernel = kernel_choice, kernel

    def __enter__(self):
        self.saved = self.module.varlen_kernel
        self.module.varlen_kernel = lambda dropout, kernel=self.kernel: kernel
        torch._dynamo.reset()

    def __exit__(self, *exc):
        self.module.varlen_kernel = self.saved
        torch._dynamo.reset()


def _rope_rows(name, args, device, dtype, tokens):
    """(label, fwd seconds, fwd+bwd seconds) for one model's q/k shapes."""
    from tfcompat.rope import apply_rope, impl_for

    family, shape, section = SHAPES[name]
    shape = TINY[0] if args.tiny else shape
    hq, hk, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    model = _model(name, 1, device, dtype, args.tiny)
    config = model.config
    q = torch.randn(1, tokens, hq, d, device=device, dtype=dtype)
    k = torch.randn(1, tokens, hk, d, device=device, dtype=dtype)
    text = getattr(model.model, "language_model", model.model)
    positions = torch.arange(tokens, device=device)[None]
    if section:
        positions = positions.expand(3, 1, -1)
    cos, sin = text.rotary_emb(q, positions)
    upstream = _upstream_rope(family, config)
    impl = impl_for(device)
    paths = {"copy (the limit)": lambda a, b: (a.clone(), b.clone()),
             f"tfcompat ({impl})": lambda a, b: apply_rope(a, b, cos, sin, config=config, unsqueeze_dim=2),
             "upstream's function": lambda a, b: upstream(a, b, cos, sin, unsqueeze_dim=2)}
    liger = _liger()
    if liger is not None and device.type == "cuda" and not section:
        # Liger's layout: (batch, heads, seq, dim), cos/sin (1, seq, dim)
        paths["Liger-Kernel"] = lambda a, b: tuple(
            t.transpose(1, 2) for t in liger(a.transpose(1, 2), b.transpose(1, 2), cos, sin))
    rows = []
    for label, fn in paths.items():
        def fwd(fn=fn):
            with torch.no_grad():
                fn(q, k)

        def both(fn=fn):
            a, b = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
            oa, ob = fn(a, b)
            (oa.float().sum() + ob.float().sum()).backward()

        try:
            rows.append((label, _timed(fwd, device, args.warmup, args.repeats)[0],
                         _timed(both, device, args.warmup, args.repeats)[0]))
        except Exception as exc:
            rows.append((label, None, None))
            print(f"  {label}: {type(exc).__name__}: {str(exc)[:100]}")
    return rows


def _upstream_rope(family, config):
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    if hasattr(module, "apply_multimodal_rotary_pos_emb"):  # 4.x: the attention folds the 3 rows itself
        from tfcompat.config import rope_parameters

        section = list(rope_parameters(config).mrope_section)
        return lambda q, k, cos, sin, unsqueeze_dim: module.apply_multimodal_rotary_pos_emb(
            q, k, cos, sin, section, unsqueeze_dim=unsqueeze_dim)
    return module.apply_rotary_pos_emb


def _liger():
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except Exception:
        return None
    return LigerRopeFunction.apply


FAILURES = []


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes: a dry run of every path (the CPU default)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", default=None, help="comma-separated packed-row sizes (default 16384,65536)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--tol", type=float, default=2e-2, help="relative loss difference allowed (bf16)")
    p.add_argument("--backend", default=None, help="torch.compile backend (default inductor; aot_eager on CPU)")
    p.add_argument("--only", choices=("step", "rope"), default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_step: no CUDA device here; run with --device cpu --tiny for the dry run")
    args.tiny = args.tiny or device.type == "cpu"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.tol = args.tol if device.type == "cuda" or args.tol != 2e-2 else 1e-4
    args.backend = args.backend or ("inductor" if device.type == "cuda" else "aot_eager")
    args.warmup = args.warmup if args.warmup is not None else (3 if device.type == "cuda" else 1)
    args.repeats = args.repeats if args.repeats is not None else (5 if device.type == "cuda" else 1)
    sizes = [int(x) for x in (args.tokens or ("96,160" if args.tiny else "16384,65536")).split(",")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_step: {name}, torch {torch.__version__}, transformers {__import__('transformers').__version__}, "
          f"tfcompat {tfcompat.__version__}, {dtype}, {args.layers} layers"
          + (" (a dry run on small shapes: no timing claims)" if args.tiny else ""))
    start = time.perf_counter()
    for shape in SHAPES:
        for tokens in sizes:
            if args.only in (None, "step"):
                rows = _step_rows(shape, args, device, dtype, tokens)
                print(f"\nstep {shape}, {tokens} tokens: tokens/s, peak memory, loss (ratios: against the unpatched "
                      f"padded batch / upstream's packed sdpa row)")
                padded = rows[0][1]
                packed = next((r[1] for r in rows if r[0].startswith("upstream packed row (sdpa)")), None)
                for label, rate, peak, loss, note in rows:
                    if rate is None:
                        print(f"  {label:<42} -  ({note})")
                        continue
                    mem = f"{peak / 2**30:6.2f} GiB" if peak is not None else "     -"
                    ratios = f"{rate / padded:5.2f}x / " + (f"{rate / packed:5.2f}x" if packed else "-")
                    print(f"  {label:<42} {rate:>10.0f}  {mem}  {loss:.5f}  {ratios}  {note}")
            if args.only in (None, "rope"):
                rows = _rope_rows(shape, args, device, dtype, tokens)
                print(f"\nrope {shape}, {tokens} tokens: forward ms, forward+backward ms (x the copy)")
                copy_f, copy_b = rows[0][1], rows[0][2]
                for label, f, b in rows:
                    if f is None:
                        continue
                    print(f"  {label:<30} {f * 1e3:8.3f} ({f / copy_f:4.2f}x)  {b * 1e3:8.3f} ({b / copy_b:4.2f}x)")
    print(f"\ngpu_step: {time.perf_counter() - start:.0f} s; "
          + ("FAIL: " + "; ".join(FAILURES) if FAILURES else "every exact path equals the padded batch: PASS"))
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
