"""The training recipes on a GPU, one script of about 3 minutes: what CPU tests cannot show for the CUDA path.

    python bench/gpu_recipes.py                 # needs CUDA (``--device cpu`` runs the same checks here, as a dry run)

Each check runs a patched tiny model the way a trainer calls it, on the GPU, against the unpatched model (the
oracle) on the padded batch of the same rows, and prints one line: ok / FAIL, the numbers, the kernels proven.

1. The first training step under activation checkpointing (non-reentrant, transformers 5.x's default, and
   reentrant), the Triton RoPE kernel and the GPU attention kernel proven on first use inside the checkpointed
   forward: the step finishes (a deadlock fails the script by a watchdog), logits and gradients equal upstream's.
2. An ``inference_mode`` rollout first, then a training step in the same process: the kernels are proven for
   training (the rollout's tensors cannot be saved for backward), gradients equal upstream's.
3. Per-layer ``torch.compile`` with inductor (real Triton code generation) over steps with different packed
   boundaries: graphs against the unpatched model compiled the same way, no recompile-limit warning, compiled
   equals eager.
4. The whole model, ``fullgraph=True``, inductor: compiled equals eager on packed rows.
5. bf16 over the collator's kwargs: ``tfcompat.warmup`` proves the GPU varlen kernel, then the fullgraph-compiled
   model's graphs call it (not SDPA), compiled equals eager.
6. ``generate()`` (greedy) of a VL family with an image: the same tokens as the unpatched model.
Exits non-zero on any failure.
"""

import argparse
import faulthandler
import logging
import os
import sys
import time
import traceback

import torch

import tfcompat
from tfcompat._kernels import table
from tfcompat.packing import pack, unpack
from tfcompat.testing import assert_close_to_model, padded_batch, tiny_model, tiny_pixels, tiny_sequence

FAILURES = []


def line(ok, label, text):
    print(f"[{'ok' if ok else 'FAIL'}] {label}: {text}", flush=True)
    if not ok:
        FAILURES.append(label)


def kernels():
    return sorted({f"{r['op']}:{r['kernel']}:{'ok' if r['ok'] else 'failed'}" for r in table.proven()})


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(label, got_logits, want_logits, got_grads=None, want_grads=None):
    """Max abs differences against the oracle, and whether every one is within the whole-model tolerance."""
    worst, bad = (got_logits - want_logits).abs().max().item(), []
    try:
        assert_close_to_model(got_logits, want_logits, "logits")
    except AssertionError:
        bad.append("logits")
    for name in want_grads or {}:
        if name not in got_grads:
            bad.append(f"{name} (no gradient)")
            continue
        worst = max(worst, (got_grads[name] - want_grads[name]).abs().max().item())
        try:
            assert_close_to_model(got_grads[name], want_grads[name], name)
        except AssertionError:
            bad.append(name)
    line(not bad, label, f"max abs diff {worst:.2e}{'; off: ' + ', '.join(bad[:4]) if bad else ''}; "
                         f"kernels {kernels()}")


ROWS = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16], [17, 18, 19, 20, 21, 22]]


def oracle(name, dev, rows=ROWS, train=True, **overrides):
    ids, mask = padded_batch(rows)
    ids, mask = ids.to(dev), mask.to(dev)
    ref = tiny_model(name, **overrides).to(dev)
    ref.train(train)
    ref.config.use_cache = False
    want = ref(input_ids=ids, attention_mask=mask).logits
    (want * mask[..., None]).sum().backward()
    return ids, mask, want.detach()[mask.bool()], grads(ref)


def checkpointed_first_step(name, dev, mode):
    tfcompat.clear_cache()
    ids, mask, want, want_g = oracle(name, dev)
    model = tiny_model(name).to(dev)
    model.train()
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
    tfcompat.patch(model)
    pk = pack(ids, mask)
    faulthandler.dump_traceback_later(120, exit=True)  # a deadlock ends the script with every thread's stack
    start = time.perf_counter()
    out = model(input_ids=pk.input_ids, position_ids=pk.position_ids).logits
    out.sum().backward()
    faulthandler.cancel_dump_traceback_later()
    got = unpack(out.detach(), pk)[mask.bool()]
    compare(f"{name} first step, {mode} checkpointing ({time.perf_counter() - start:.1f} s)", got, want,
            grads(model), want_g)


def inference_then_training(name, dev):
    tfcompat.clear_cache()
    ids, mask, want, want_g = oracle(name, dev)
    model = tiny_model(name).to(dev)
    tfcompat.patch(model)
    pk = pack(ids, mask)
    with torch.inference_mode():  # the rollout: its tensors cannot be saved for backward
        rollout = unpack(model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False).logits, pk)
    model.train()
    out = model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False).logits
    out.sum().backward()
    got = unpack(out.detach(), pk)[mask.bool()]
    assert_close_to_model(rollout[mask.bool()].clone(), want, "rollout logits")
    compare(f"{name} inference_mode rollout, then a training step", got, want, grads(model), want_g)


class _LimitHit(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        if "recompile_limit" in record.getMessage() or "cache_size_limit" in record.getMessage():
            self.messages.append(record.getMessage())


def _rows(step):
    g = torch.Generator().manual_seed(step)
    count = int(torch.randint(1, 5, (1,), generator=g))
    return [torch.randint(5, 60, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (count,), generator=g)]


def _steps(name, dev, patched, layers, compiled, steps, fullgraph=False):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = tiny_model(name, num_hidden_layers=layers).to(dev)
    model.train()
    if patched:
        tfcompat.patch(model)
    counter = CompileCounterWithBackend("inductor")
    if compiled == "layers":
        for layer in model.model.layers if hasattr(model.model, "layers") else model.model.language_model.layers:
            layer.compile(backend=counter)
    elif compiled == "whole":
        model.compile(backend=counter, fullgraph=fullgraph)
    outs = []
    for step in range(steps):
        ids, mask = padded_batch(_rows(step))
        ids, mask = ids.to(dev), mask.to(dev)
        if patched:
            pk = pack(ids, mask)
            logits = unpack(model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False).logits, pk)
        else:
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        (logits * mask[..., None]).sum().backward()
        outs.append((logits.detach()[mask.bool()], grads(model)))
        model.zero_grad()
    return outs, counter.frame_count


def compiled_like_upstream(name, dev, how, layers, steps):
    hit = _LimitHit()
    logging.getLogger("torch._dynamo").addHandler(hit)
    start = time.perf_counter()
    try:
        got, graphs = _steps(name, dev, True, layers, how, steps, fullgraph=how == "whole")
        seconds = time.perf_counter() - start
        _, plain = _steps(name, dev, False, layers, how, steps)
    finally:
        logging.getLogger("torch._dynamo").removeHandler(hit)
        torch._dynamo.reset()
    want, _ = _steps(name, dev, True, layers, None, steps)
    worst, bad = 0.0, []
    for step, ((g, gg), (w, wg)) in enumerate(zip(got, want)):
        worst = max(worst, (g - w).abs().max().item())
        try:
            assert_close_to_model(g, w, f"step {step} logits")
            for key in wg:
                assert_close_to_model(gg[key], wg[key], f"step {step} {key}")
        except (AssertionError, KeyError) as exc:
            bad.append(str(exc).splitlines()[0][:120])
    label = (f"{name} compiled ({how}{', fullgraph' if how == 'whole' else ''}, inductor, {layers} layers, "
             f"{steps} steps)")
    ok = not bad and not hit.messages and (how == "whole" or graphs <= plain + 2)
    line(ok, label, f"graphs {graphs} (unpatched {plain}), recompile-limit warnings {len(hit.messages)}, "
                    f"compiled vs eager max abs {worst:.2e}, {seconds:.0f} s{'; ' + bad[0] if bad else ''}")


def compiled_calls_the_kernel(name, dev):
    """bf16, the collator's kwargs (cu_seq_lens, max_length): tfcompat.warmup proves the GPU varlen kernel, then
    the fullgraph-compiled model's graphs call it (not SDPA), and compiled equals eager."""
    import inspect

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from transformers import DataCollatorWithFlattening

    if "return_flash_attn_kwargs" not in inspect.signature(DataCollatorWithFlattening.__init__).parameters:
        line(True, f"{name} compiled with a proven kernel", "skipped: no return_flash_attn_kwargs")
        return
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)

    def batch(step):
        rows = [list(range(5 + step, 5 + step + n)) for n in ((40, 70, 33), (90, 12), (64, 64, 17, 5))[step]]
        return {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in collator(
            [{"input_ids": r} for r in rows]).items()}

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    tfcompat.clear_cache()
    torch._dynamo.reset()
    model = tiny_model(name, dtype=torch.bfloat16).to(dev)
    model.train()
    tfcompat.patch(model)
    proofs = tfcompat.warmup(model, dict(batch(0), use_cache=False))
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
    worst, bad = 0.0, []
    for step in range(3):
        out = compiled(**batch(step), use_cache=False)
        want = model(**batch(step), use_cache=False)
        worst = max(worst, (out.logits.float() - want.logits.float()).abs().max().item())
        if not torch.allclose(out.loss.float(), want.loss.float(), rtol=2e-2, atol=2e-2):
            bad.append(f"step {step} loss {out.loss.item():.4f} vs eager {want.loss.item():.4f}")
        out.loss.backward()
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    kernel = sorted({t for t in targets if "varlen" in t or "flash_attn" in t})
    sdpa = sorted({t for t in targets if "scaled_dot_product" in t})
    ok = bool(kernel) and not sdpa and not bad
    line(ok, f"{name} bf16 fullgraph compile after warmup", f"proofs {[(p['kernel'], p['ok']) for p in proofs]}; "
                                                            f"graph calls {kernel}, sdpa {sdpa}; compiled vs eager "
                                                            f"logits max abs {worst:.3g}{'; ' + bad[0] if bad else ''}")
    torch._dynamo.reset()


def generate_with_image(name, dev):
    import inspect

    ids, mask = padded_batch([tiny_sequence(name, text=6, image=True)])
    ids, mask = ids.to(dev), mask.to(dev)
    pixels = {k: v.to(dev) for k, v in tiny_pixels(images=1).items()}
    kw = dict(max_new_tokens=8, do_sample=False)
    out = []
    for patched in (False, True):
        model = tiny_model(name).to(dev)
        if patched:
            tfcompat.patch(model)
        extra = dict(pixels)
        if "mm_token_type_ids" in inspect.signature(type(model).forward).parameters:
            extra["mm_token_type_ids"] = (ids == model.config.image_token_id).long()
        out.append(model.generate(input_ids=ids, attention_mask=mask, **extra, **kw))
    line(torch.equal(*out), f"{name} generate() with an image, greedy", f"tokens equal: {torch.equal(*out)} "
                                                                         f"({out[1][0, ids.shape[1]:].tolist()})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=12,
                        help="decoder layers of the per-layer compile check (past dynamo's recompile limit, 8)")
    parser.add_argument("--only", default="", help="run the checks whose label holds this text")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check (--device cpu runs the checks here)")
        return 2
    dev = torch.device(args.device)
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, tfcompat {tfcompat.__version__}, "
          f"device {torch.cuda.get_device_name() if dev.type == 'cuda' else dev}", flush=True)
    if dev.type == "cuda":
        os.environ.setdefault("TFCOMPAT_ROPE_IMPL", "auto")
    checks = [
        ("checkpointed first step", lambda: checkpointed_first_step("qwen3", dev, "non-reentrant")),
        ("checkpointed first step", lambda: checkpointed_first_step("qwen3", dev, "reentrant")),
        ("checkpointed first step", lambda: checkpointed_first_step("qwen2_5_vl", dev, "non-reentrant")),
        ("inference_mode, then training", lambda: inference_then_training("qwen3", dev)),
        ("per-layer compile", lambda: compiled_like_upstream("qwen3", dev, "layers", args.layers, 6)),
        ("whole-model compile", lambda: compiled_like_upstream("qwen2", dev, "whole", 2, 3)),
        ("compiled with a proven kernel", lambda: compiled_calls_the_kernel("qwen3", dev)),
        ("generate with an image", lambda: generate_with_image("qwen2_5_vl", dev)),
        ("generate with an image", lambda: generate_with_image("qwen3_vl", dev)),
    ]
    for label, check in checks:
        if args.only and args.only not in label:
            continue
        try:
            check()
        except Exception as exc:  # a check that raises is a failed line; the others still run
            where = traceback.extract_tb(exc.__traceback__)[-1]
            line(False, label, f"{type(exc).__name__}: {str(exc)[:300]} (at {os.path.basename(where.filename)}:"
                               f"{where.lineno})")
    print(f"{len(FAILURES)} failed" if FAILURES else "all recipe checks passed", flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
