"""First-use proofs inside the recipes users train and generate in: activation checkpointing in every mode (the
first use inside and outside the checkpointed region), ``inference_mode`` and ``no_grad`` rollouts, and the places
where no proof may run (a compiled region, a CUDA graph capture).

The attention proofs run everywhere with a stand-in varlen kernel (per-sequence SDPA, the calling convention
flash-attn documents); the fused RoPE kernel's run in the Triton environments (Triton's interpreter). A deadlock
fails by timeout: every case runs on a daemon thread that the test waits for a bounded time."""

import functools
import threading
import warnings

import pytest
import torch

import tfcompat
from tfcompat._attention import kernel_choice as proofs  # private: the first-use proofs are the room under test
from tfcompat._attention.kernels import _sdpa_fallback  # private: the exact path the proofs compare against
from tfcompat._kernels import table  # private: the proof table is under test
from tfcompat.errors import TfcompatError

from _helpers import rotary, triton_ready

SCALE = 0.3
HEADS, KV, DIM = 4, 2, 8
BOUNDS = [0, 5, 6, 13]


def _bounded(fn, seconds=120):
    """fn() on a daemon thread; a test failure (not a hang) when it has not returned in ``seconds``."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised on the test's thread
            box["error"] = exc

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        pytest.fail(f"did not finish in {seconds} s: the first-use proof deadlocked")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _reference(a, b, c, bounds):
    return _sdpa_fallback(a, b, c, bounds, SCALE, True, None, 0.0)


def _stand_in(a, b, c, cu, longest):
    """A varlen kernel with flash-attn's calling convention (cu_seqlens int32, causal), computed per sequence."""
    return _sdpa_fallback(a, b, c, cu.tolist(), SCALE, True, None, 0.0)


class _Layer(torch.nn.Module):
    """Projections, the stand-in kernel behind its first-use proof (as the patched attention calls it), a mix."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.qkv = torch.nn.Parameter(torch.randn(16, (HEADS + 2 * KV) * DIM, generator=g) * 0.2)
        self.out = torch.nn.Parameter(torch.randn(HEADS * DIM, 16, generator=g) * 0.2)
        self.used = []  # the kernel that served each call

    def forward(self, x):
        qkv = x @ self.qkv
        q, k, v = qkv.split((HEADS * DIM, KV * DIM, KV * DIM), -1)
        q, k, v = q.view(-1, HEADS, DIM), k.view(-1, KV, DIM), v.view(-1, KV, DIM)
        if proofs.proven("torch_varlen", _stand_in, _reference, q, k, v, True, SCALE, None):
            self.used.append("kernel")
            o = _stand_in(q, k, v, torch.tensor(BOUNDS, dtype=torch.int32), 7)
        else:
            self.used.append("fallback")
            o = _reference(q, k, v, BOUNDS)
        return torch.tanh(o.reshape(-1, HEADS * DIM) @ self.out)


def _checkpointed(layer, mode):
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if mode == "none":
        return layer
    if mode == "reentrant":
        return lambda x: checkpoint(layer, x, use_reentrant=True)
    if mode == "non_reentrant":
        return lambda x: checkpoint(layer, x, use_reentrant=False)
    if mode == "selective":  # selective checkpointing: saves the matmuls, recomputes the rest
        ops = [torch.ops.aten.mm.default, torch.ops.aten.bmm.default,
               torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default]
        context = functools.partial(create_selective_checkpoint_contexts, ops)
        return lambda x: checkpoint(layer, x, use_reentrant=False, context_fn=context)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper(layer)  # torch's wrapper (FSDP2 recipes): non-reentrant


def _step(mode, warm):
    """Forward + backward of the layer under ``mode``; ``warm``: the kernel proven before (outside the region)."""
    tfcompat.clear_cache()
    layer = _Layer()
    x = torch.randn(13, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    if warm:
        with torch.no_grad():
            layer(x)
    run = _checkpointed(layer, mode)
    y = run(x * 1)
    (y * torch.arange(y.numel()).view_as(y).sin()).sum().backward()
    return y.detach(), x.grad, layer.qkv.grad, layer.out.grad, layer.used


@pytest.mark.parametrize("warm", [False, True], ids=["first-use-inside", "first-use-outside"])
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant", "checkpoint_wrapper", "selective"])
def test_attention_proof_inside_every_checkpoint_mode(mode, warm):
    """The proof's own backward inside a checkpointed layer: no deadlock (the non-reentrant checkpoint used to
    recompute the layer, re-enter first_use and wait on its own lock), the kernel proven and used, and the layer's
    outputs and gradients those of the same layer without checkpointing."""
    want = _bounded(lambda: _step("none", warm))
    got = _bounded(lambda: _step(mode, warm))
    for g, w, what in zip(got[:4], want[:4], ("output", "x.grad", "qkv.grad", "out.grad")):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=lambda m, what=what: f"{mode}: {what}: {m}")
    assert set(got[4]) == {"kernel"}, got[4]
    assert [r["ok"] for r in table.proven()] == [True]
    tfcompat.clear_cache()


@pytest.mark.parametrize("context", ["inference_mode", "no_grad"])
def test_attention_proof_under_inference_mode(context):
    """An RL rollout or an eval before training: the caller's q, k, v are inference tensors. The proof passes
    there, and the training step after it finds the kernel proven (nothing failed, nothing recorded as failed)."""
    tfcompat.clear_cache()
    layer = _Layer()
    x = torch.randn(13, 16, generator=torch.Generator().manual_seed(1))
    with (torch.inference_mode() if context == "inference_mode" else torch.no_grad()):
        layer(x)
    assert [r["ok"] for r in table.proven()] == [True], table.proven()
    layer(x.requires_grad_(True)).sum().backward()
    assert layer.used == ["kernel", "kernel"]
    tfcompat.clear_cache()


def test_a_failure_under_no_grad_is_proven_again_by_a_training_call():
    """A failure recorded in a no-grad or inference context serves that context only: the first training call
    proves the kernel again (once), so one rollout cannot cost the training that follows its kernel."""
    tfcompat.clear_cache()
    layer = _Layer()
    q, k, v = (torch.randn(13, h, DIM, generator=torch.Generator().manual_seed(h)) for h in (HEADS, KV, KV))
    flaky = {"calls": 0}

    def first_call_wrong(a, b, c, cu, longest):
        flaky["calls"] += 1
        out = _stand_in(a, b, c, cu, longest)
        return out * 2 if flaky["calls"] <= 1 else out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with torch.no_grad():
            assert not proofs.proven("torch_varlen", first_call_wrong, _reference, q, k, v, True, SCALE, None)
            assert not proofs.proven("torch_varlen", first_call_wrong, _reference, q, k, v, True, SCALE, None)
    assert flaky["calls"] == 1  # recorded for the no-grad context: not re-run there
    assert proofs.proven("torch_varlen", first_call_wrong, _reference, q, k, v, True, SCALE, None)
    assert [r["ok"] for r in table.proven()] == [True]
    del layer
    tfcompat.clear_cache()


def test_no_proof_runs_where_none_may():
    """The decision is pure (a CUDA graph capture cannot happen on CPU): compiling or capturing blocks a proof."""
    assert table.blocked(False, False) == ""
    assert "torch.compile" in table.blocked(True, False)
    assert "CUDA graph" in table.blocked(False, True)


def test_a_blocked_proof_records_nothing(monkeypatch):
    """Under a capture (here: the capture probe answering yes) ``auto`` takes the proven path without recording a
    failure, an explicit choice raises saying to warm up, and the next eager call proves the kernel."""
    tfcompat.clear_cache()
    q, k, v = (torch.randn(13, h, DIM, generator=torch.Generator().manual_seed(h)) for h in (HEADS, KV, KV))

    def run():
        return (torch.ones(2),)

    monkeypatch.setattr(table, "_capturing", lambda device: True)
    assert not proofs.proven("torch_varlen", _stand_in, _reference, q, k, v, True, SCALE, None)
    with pytest.raises(TfcompatError, match="Warm up first"):
        table.first_use("rope", "triton", "cuda:0", ("k",), run, run, True)
    assert table.proven() == []
    monkeypatch.setattr(table, "_capturing", lambda device: False)
    assert proofs.proven("torch_varlen", _stand_in, _reference, q, k, v, True, SCALE, None)
    tfcompat.clear_cache()


def test_capture_probe_reads_only_cuda_devices():
    """On a CPU device the capture probe asks CUDA nothing (a CPU-only torch has no CUDA to ask)."""
    assert table._capturing("cpu") is False
    assert table._capturing(torch.device("cpu")) is False


# --- the fused RoPE kernel (Triton's interpreter) -------------------------------------------------------------------
TRITON = pytest.mark.skipif(not triton_ready(), reason="needs triton in its interpreter (TRITON_INTERPRET=1)")


@TRITON
@pytest.mark.parametrize("context", ["inference_mode", "no_grad"])
def test_rope_proof_under_inference_mode(context):
    """cos/sin from the rotary module under inference_mode are inference tensors: the proof clones them, the
    kernel serves the call and equals the composite, and a training call after it uses the kernel too."""
    from tfcompat._rope import fused  # private: the Triton kernel is the room under test
    from tfcompat.rope import apply_rope

    tfcompat.clear_cache()
    from tfcompat.config import rope_parameters

    rot, config = rotary("qwen3")
    dim = rope_parameters(config).head_dim
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 9, dim, generator=g), torch.randn(2, 2, 9, dim, generator=g)
    pos = torch.arange(9).expand(2, 9)
    with (torch.inference_mode() if context == "inference_mode" else torch.no_grad()):
        cos, sin = rot(q, pos)
        got = apply_rope(q, k, cos, sin, config=config, impl="triton")
        want = apply_rope(q, k, cos, sin, config=config, impl="composite")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    cos, sin = rot(q, pos)
    qg = q.clone().requires_grad_(True)
    before = fused.launches
    oq, ok = apply_rope(qg * 1, k, cos, sin, config=config, impl="triton")
    (oq.sum() + ok.sum()).backward()
    assert fused.launches == before + 2  # the kernel forward and backward: nothing failed, nothing fell back
    assert all(r["ok"] for r in table.proven())
    tfcompat.clear_cache()


@TRITON
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_rope_kernel_in_a_checkpointed_first_training_step(mode, monkeypatch):
    """transformers' own gradient_checkpointing_enable (5.x: non-reentrant) on a patched tiny qwen3, a packed row,
    the Triton RoPE forced: the first training step finishes, the kernel proven, and the logits and gradients equal
    the unpatched model's on the padded batch."""
    from tfcompat.packing import pack, unpack
    from tfcompat.testing import assert_close_to_model, tiny_model

    from _helpers import param_grads
    from _models import padded

    monkeypatch.setenv("TFCOMPAT_ROPE_IMPL", "triton")
    tfcompat.clear_cache()
    ids, mask = padded([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]])

    def model():
        m = tiny_model("qwen3")
        m.train()
        m.config.use_cache = False
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
        return m

    ref = model()
    want = ref(input_ids=ids, attention_mask=mask).logits
    (want * mask[..., None]).sum().backward()
    patched = model()
    tfcompat.patch(patched)
    pk = pack(ids, mask)

    def step():
        out = patched(input_ids=pk.input_ids, position_ids=pk.position_ids).logits
        out.sum().backward()
        return out

    got = unpack(_bounded(step, 300), pk)
    assert_close_to_model(got[mask.bool()], want[mask.bool()], "logits")
    got_g, want_g = param_grads(patched), param_grads(ref)
    for name in want_g:
        assert_close_to_model(got_g[name], want_g[name], name)
    assert any(r["kernel"] == "triton" and r["ok"] for r in table.proven()), table.proven()
    tfcompat.clear_cache()


@TRITON
def test_rope_launch_goes_to_the_tensors_device():
    """Several GPUs per process: the launch makes q's device current (Triton then launches on it and on its current
    stream). A CUDA device cannot be entered here; the context the launch enters is checked for each device."""
    from tfcompat._rope import fused  # private: the Triton kernel is the room under test

    ctx = fused.launch_context(torch.device("cuda", 1))
    assert isinstance(ctx, torch.cuda.device) and ctx.idx == 1
    assert fused.launch_context("cuda:3").idx == 3
    assert not isinstance(fused.launch_context("cpu"), torch.cuda.device)


# --- what a proof sees: kernels wrong in one part of the call must fail it --------------------------------------
def _wrong_for_last_head(a, b, c, cu, longest):
    out = _stand_in(a, b, c, cu, longest)
    return torch.cat((out[:, :-1], out[:, -1:] + 1), dim=1)


def _window_ignored_from_32(window):
    def kernel(a, b, c, cu, longest):
        return _sdpa_fallback(a, b, c, cu.tolist(), SCALE, True, window if window < 32 else None, 0.0)
    return kernel


@pytest.mark.parametrize("case", ["last_head", "window_40", "window_32"])
def test_attention_proof_fails_a_kernel_wrong_in_one_part(case):
    """Every head of the call is in the proof's piece, and one of its sequences is longer than the window: a
    kernel wrong only for the last head, or one that ignores windows of 32 and more, fails; with a window below
    32 that kernel is right, and passes."""
    tfcompat.clear_cache()
    q, k, v = (torch.randn(20, h, DIM, generator=torch.Generator().manual_seed(h)) for h in (HEADS, KV, KV))
    window = {"last_head": None, "window_40": 40, "window_32": 32}[case]
    kernel = _wrong_for_last_head if case == "last_head" else _window_ignored_from_32(window)

    def reference(a, b, c, bounds):
        return _sdpa_fallback(a, b, c, bounds, SCALE, True, window, 0.0)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert not proofs.proven("torch_varlen", kernel, reference, q, k, v, True, SCALE, window)
    def reference8(a, b, c, bounds):
        return _sdpa_fallback(a, b, c, bounds, SCALE, True, 8, 0.0)

    assert proofs.proven("flash_attn", _window_ignored_from_32(8), reference8, q, k, v, True, SCALE, 8)
    tfcompat.clear_cache()


def test_an_empty_call_proves_nothing():
    """A kernel that writes zeros passes a proof on an empty call: an empty call is served unproven by the exact
    path and records nothing."""
    tfcompat.clear_cache()
    q, k, v = torch.zeros(0, HEADS, DIM), torch.zeros(0, KV, DIM), torch.zeros(0, KV, DIM)
    assert not proofs.proven("torch_varlen", _stand_in, _reference, q, k, v, True, SCALE, None)
    assert table.proven() == []


@TRITON
@pytest.mark.parametrize("wrong", ["past_token_8", "last_head", "last_row", "empty"])
def test_rope_proof_fails_a_kernel_wrong_in_one_part(wrong, monkeypatch):
    """The fused kernel replaced by one that is wrong only past token 8, only for the last head or only for the
    last batch row: the proof's slice covers those, so impl="triton" refuses it by name (the proof used to rotate
    batch row 0, tokens 0-7). An empty call is never a proof: it records nothing."""
    from tfcompat._rope import fused  # private: the Triton kernel is the room under test
    from tfcompat.config import rope_parameters
    from tfcompat.rope import apply_rope

    real = fused.rope

    def bad(q, k, cos, sin, layout, seq_dim, inplace=False):
        oq, ok = real(q, k, cos, sin, layout, seq_dim, inplace=inplace)
        if wrong == "past_token_8" and oq.shape[seq_dim] > 8:
            n = oq.shape[seq_dim]
            return torch.cat((oq.narrow(seq_dim, 0, 8), oq.narrow(seq_dim, 8, n - 8) + 1), seq_dim), ok
        head_dim = 1 if seq_dim == 2 else 2
        if wrong == "last_head":
            n = oq.shape[head_dim]
            return torch.cat((oq.narrow(head_dim, 0, n - 1), oq.narrow(head_dim, n - 1, 1) * 2), head_dim), ok
        if wrong == "last_row" and oq.shape[0] > 1:
            return torch.cat((oq[:-1], -oq[-1:])), ok
        return oq, ok

    monkeypatch.setattr(fused, "rope", bad)
    tfcompat.clear_cache()
    rot, config = rotary("qwen3")
    dim = rope_parameters(config).head_dim
    g = torch.Generator().manual_seed(0)
    seq = 0 if wrong == "empty" else 12
    q, k = torch.randn(2, 4, seq, dim, generator=g), torch.randn(2, 2, seq, dim, generator=g)
    cos, sin = rot(q, torch.arange(seq).expand(2, seq))
    if wrong == "empty":
        apply_rope(q, k, cos, sin, config=config, impl="triton")
        assert table.proven() == []
    else:
        with pytest.raises(TfcompatError, match="failed its first-use proof"):
            apply_rope(q, k, cos, sin, config=config, impl="triton")
    tfcompat.clear_cache()


# --- the GPU path's smaller defects -----------------------------------------------------------------------------
@TRITON
def test_rope_kernel_backward_keeps_the_gradients_layout():
    """The kernel's backward writes the input gradient in the output gradient's own layout (a (b, s, h, d)
    projection seen as (b, h, s, d) stays that, so the projection's backward reads it without a copy); it
    allocated a contiguous one."""
    from tfcompat.config import rope_parameters
    from tfcompat.rope import apply_rope

    tfcompat.clear_cache()
    rot, config = rotary("qwen3")
    dim = rope_parameters(config).head_dim
    g = torch.Generator().manual_seed(0)
    proj = torch.randn(2, 9, 4, dim, generator=g, requires_grad=True)
    q = proj * 1
    k = torch.randn(2, 2, 9, dim, generator=g)
    cos, sin = rot(q, torch.arange(9).expand(2, 9))
    seen = []
    qt = q.transpose(1, 2)
    qt.register_hook(lambda grad: seen.append(grad.stride()))
    oq, ok = apply_rope(qt, k, cos, sin, config=config, impl="triton")
    grad = torch.randn(2, 9, 4, dim, generator=g).transpose(1, 2)  # dense, (b, s, h, d) in memory
    oq.backward(grad)
    assert seen == [grad.stride()], (seen, grad.stride())
    tfcompat.clear_cache()


def test_patched_attention_backward_allocates_no_zero_filled_gradient():
    """The patched attention took q[0] of its (1, heads, s, d) tensors: select's backward allocates and zero-fills
    a whole gradient per tensor (about 0.6 GB a layer at 16k tokens on a 7B model). squeeze's backward is a view."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tfcompat.packing import pack
    from tfcompat.testing import padded_batch, tiny_model

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    model = tiny_model("qwen2")
    tfcompat.patch(model)
    pk = pack(*padded_batch([[5, 6, 7, 8, 9], [10, 11, 12]]))
    out = model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False).logits
    ops = Ops()
    with ops:
        out.sum().backward()
    assert not [n for n in ops.names if "select_backward" in n], sorted(set(ops.names))
