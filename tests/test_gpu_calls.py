"""tfcompat's calls into GPU attention libraries, bound against those libraries' real signatures and checked against
their documented conventions (tfcompat/_attention/gpu_calls.py keeps flash-attn's signatures as data: it cannot
be installed here; torch's varlen_attn is read from the installed torch, live and from its file).

The conventions are checked by arithmetic on CPU: the mask flash-attn documents for the (causal, window_size) tfcompat
passes, run through SDPA, equals tfcompat's exact fallback. What only a GPU can show (bottom-right causal alignment
when cu_q != cu_k) is named in ``report`` and measured by bench/gpu_check.py."""

import inspect

import pytest
import torch
from packaging.version import Version

from tfcompat._attention import gpu_calls as calls  # private: the calling conventions are the room under test
from tfcompat._attention import kernel_choice as proofs  # private: the first-use proofs are the room under test
from tfcompat._attention.kernels import _sdpa_fallback  # private: the exact path the proofs compare against
from tfcompat._probe import backends as _backends  # private: the kernel choice per machine is under test

FLASH2 = calls.signature(calls.FLASH_ATTN_2["spec"])
FLASH3 = calls.signature(calls.FLASH_ATTN_3["spec"])
TORCH_SIGS = {name: calls.signature(spec) for name, spec in calls.TORCH_VARLEN.items()}


def _row(heads=4, kv_heads=2, total=11, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total, heads, dim, generator=g)
    k = torch.randn(total, kv_heads, dim, generator=g)
    v = torch.randn(total, kv_heads, dim, generator=g)
    return q, k, v, torch.tensor([0, 4, 5, total], dtype=torch.int32)


def _flash_mask(sq, sk, causal, window_size):
    """The keys query i may attend to, as flash-attn 2.7/2.8's docstring states: causal aligned bottom-right, and a
    window of keys ``[i + sk - sq - left, i + sk - sq + right]`` inclusive (-1: unbounded)."""
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    left, right = window_size
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


def _by_convention(q, k, v, cu, causal, window_size, scale):
    """What a kernel following the documented convention computes: per sequence, SDPA with that mask."""
    outs, bounds = [], cu.tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        n = hi - lo
        qs, ks, vs = (t[lo:hi].transpose(0, 1) for t in (q, k, v))
        mask = _flash_mask(n, n, causal, window_size)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 1, 3])
def test_flash_attn_2_call_binds_and_means_what_the_fallback_computes(causal, window):
    q, k, v, cu = _row()
    args, kwargs = calls.flash_call(q, k, v, cu, 6, causal=causal, scale=0.3, window=window, dropout_p=0.0)
    bound = FLASH2.bind(*args, **kwargs).arguments
    assert bound["cu_seqlens_q"] is cu and bound["cu_seqlens_k"] is cu and bound["cu_seqlens_q"].dtype == torch.int32
    assert bound["max_seqlen_q"] == bound["max_seqlen_k"] == 6 and bound["softmax_scale"] == 0.3
    assert bound["causal"] is causal and bound["dropout_p"] == 0.0
    got = _by_convention(q, k, v, cu, bound["causal"], bound["window_size"], bound["softmax_scale"])
    want = _sdpa_fallback(q, k, v, cu.tolist(), 0.3, causal, window, 0.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(calls.TORCH_VARLEN))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 2])
def test_torch_varlen_call_binds_and_means_what_the_fallback_computes(name, causal, window):
    """torch's varlen_attn runs causal only for ``window_size == (-1, 0)`` (compared as a tuple), else flash-attn's
    window; GQA needs ``enable_gqa`` where the signature has it."""
    sig = TORCH_SIGS[name]
    q, k, v, cu = _row()
    args, kwargs = calls.torch_call(q, k, v, cu, 6, causal=causal, scale=0.3, window=window,
                                    params=frozenset(sig.parameters))
    bound = sig.bind(*args, **kwargs).arguments
    assert bound["cu_seq_q"] is cu and bound["cu_seq_k"] is cu and bound["max_q"] == bound["max_k"] == 6
    assert isinstance(bound["window_size"], tuple)
    assert bound.get("enable_gqa", True) is True  # 4 query heads over 2 kv heads
    is_causal = bound["window_size"] == (-1, 0)  # torch's own rule (torch/nn/attention/varlen.py)
    got = _by_convention(q, k, v, cu, is_causal, bound["window_size"], bound["scale"])
    want = _sdpa_fallback(q, k, v, cu.tolist(), 0.3, causal, window, 0.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_torch_varlen_call_has_no_gqa_flag_for_equal_heads():
    q, k, v, cu = _row(heads=2, kv_heads=2)
    _, kwargs = calls.torch_call(q, k, v, cu, 6, causal=True, scale=None, window=None,
                                 params=frozenset(TORCH_SIGS["2.13"].parameters))
    assert kwargs["enable_gqa"] is False and kwargs["window_size"] == (-1, 0)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 1, 3])
def test_flash_attn_3_call_binds_and_means_what_the_fallback_computes(causal, window):
    """flash-attn 3's own call (read from hopper/flash_attn_interface.py): the seven leading positionals, no dropout,
    the 2.x window and causal convention, GQA by fewer kv heads; its output only (``return_attn_probs=False``)."""
    q, k, v, cu = _row()
    args, kwargs = calls.flash3_call(q, k, v, cu, 6, causal=causal, scale=0.3, window=window)
    bound = FLASH3.bind(*args, **kwargs).arguments
    assert bound["cu_seqlens_q"] is cu and bound["cu_seqlens_k"] is cu and bound["max_seqlen_q"] == 6
    assert bound["softmax_scale"] == 0.3 and bound["causal"] is causal and bound["return_attn_probs"] is False
    assert "seqused_q" not in bound and "dropout_p" not in FLASH3.parameters
    got = _by_convention(q, k, v, cu, bound["causal"], bound["window_size"], bound["softmax_scale"])
    want = _sdpa_fallback(q, k, v, cu.tolist(), 0.3, causal, window, 0.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert calls.fits(FLASH3, "flash_attn_3") == ""
    older = calls.signature((calls.FLASH_ATTN_3["spec"][0], {n: None for n in ("softmax_scale", "causal")}, ()))
    assert "window_size" in calls.fits(older, "flash_attn_3")  # a build without the keyword is not called
    out = torch.ones(2)
    assert calls.first_output((out, torch.zeros(1))) is out and calls.first_output(out) is out


def test_report_names_flash_attn_3():
    """``report`` lists flash-attn 3's row with why it does not serve here (not installed, no Hopper GPU)."""
    reasons = proofs.varlen_unfit()
    assert "flash_attn_3" in reasons and reasons["flash_attn_3"], reasons
    text = " ".join(r.reason for r in _backends.environment())
    assert "flash_attn_3" in text, text


def test_flash_attn_3_is_not_called_with_the_2x_convention():
    """flash-attn 3 puts seqused_q where 2.x has dropout_p and has no dropout: the 2.x call must not reach it."""
    q, k, v, cu = _row()
    args, kwargs = calls.flash_call(q, k, v, cu, 6, causal=True, scale=None, window=None, dropout_p=0.0)
    with pytest.raises(TypeError):
        FLASH3.bind(*args, **kwargs)
    assert "dropout_p" in calls.fits(FLASH3, "flash_attn")
    assert calls.fits(FLASH2, "flash_attn") == ""


def test_a_moved_signature_is_not_used():
    """A release that renamed the window keyword, or made the lengths keyword-only, is refused by the fit check
    (tfcompat then runs the exact SDPA path and ``report`` says why)."""
    def renamed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                causal=False, window=(-1, -1)):
        pass

    def keyword_only(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                     softmax_scale=None, causal=False, window_size=(-1, -1)):
        pass

    assert "window_size" in calls.fits(renamed, "flash_attn")
    assert "7 leading positional" in calls.fits(keyword_only, "flash_attn")
    assert calls.fits(TORCH_SIGS["2.13"], "torch_varlen") == ""


def test_installed_torch_varlen_signature_is_recorded():
    """The installed torch's varlen_attn, read live, is the recorded one for its release, and the file reader
    (used by ``report``, which imports no torch) reads the same names. Fails when torch moves the signature."""
    sig = _backends.torch_varlen_signature()
    if not _backends.torch_ships("nn/attention/varlen.py"):
        assert sig is None and _backends.varlen_kernel(False) != "torch_varlen"
        assert "torch >= 2.10" in _backends.varlen_unfit()["torch_varlen"]
        return
    from torch.nn.attention.varlen import varlen_attn

    live = inspect.signature(varlen_attn)
    assert list(live.parameters) == list(sig.parameters)
    assert [p.kind for p in live.parameters.values()] == [p.kind for p in sig.parameters.values()]
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert release in calls.TORCH_VARLEN, f"torch {release}'s varlen_attn is not recorded in gpu_calls"
    assert list(TORCH_SIGS[release].parameters) == list(live.parameters)
    assert calls.fits(varlen_attn, "torch_varlen") == ""
    assert _backends.varlen_unfit()["torch_varlen"] == ""


def test_report_names_the_unproven_convention():
    reason = _backends.environment()[1].reason
    assert "cu_q != cu_k" in reason and "gpu_check" in reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_first_use_proof(dtype):
    """The proof packed attention's GPU kernels give on first use, run on CPU with stand-ins of the kernel's calling
    convention: a kernel that computes what the documented convention says passes (once per key); one that drops
    the boundaries (attends across sequences) fails, and is then not used, with one warning."""
    import warnings

    import tfcompat
    from tfcompat._kernels import table  # private: the kernel and proof table is under test

    tfcompat.clear_cache()
    q, k, v, _ = _row(total=30)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)

    def reference(a, b, c, bounds):
        return _sdpa_fallback(a, b, c, bounds, 0.3, True, None, 0.0)

    def by_convention(a, b, c, cu, longest):  # what flash-attn's documented (causal, window) computes
        return _by_convention(a, b, c, cu, True, (-1, -1), 0.3)

    def one_sequence(a, b, c, cu, longest):  # broken: the boundaries ignored
        return _by_convention(a, b, c, torch.tensor([0, a.shape[0]]), True, (-1, -1), 0.3)

    assert proofs.proven("torch_varlen", by_convention, reference, q, k, v, True, 0.3, None)
    assert proofs.proven("torch_varlen", one_sequence, reference, q, k, v, True, 0.3, None)  # proven: not re-run
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert not proofs.proven("flash_attn", one_sequence, reference, q, k, v, True, 0.3, None)
        assert not proofs.proven("flash_attn", one_sequence, reference, q, k, v, True, 0.3, None)
    assert len([w for w in seen if "flash_attn varlen kernel failed its first-use proof" in str(w.message)]) == 1
    kinds = {(r["kernel"], r["ok"]) for r in table.proven()}
    assert kinds == {("torch_varlen", True), ("flash_attn", False)}
    tfcompat.clear_cache()


def _bench_gpu_check():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_passes_a_correct_fa2_precision_kernel_and_fails_a_wrong_one():
    """bench/gpu_check.py's rule, run on CPU: its packed-attention inputs (bf16, 1000 tokens, 8/2 heads) through an
    emulated FA2-precision kernel (bf16 in, fp32 accumulation, bf16 out) pass against the fp32 reference, though
    they differ from the bf16 fallback by more than the old 2e-2 absolute bound (gradients reach |dv| ~ 10); a
    kernel that ignores the boundaries fails."""
    gc = _bench_gpu_check()
    g = torch.Generator().manual_seed(0)
    cu = [0, 100, 101, 612, 1000]
    q, k, v = (torch.randn(1000, h, 64, generator=g).to(torch.bfloat16).requires_grad_(True) for h in (8, 2, 2))
    scale = 64 ** -0.5

    def fa2(a, b, c, bounds=cu):  # fp32 inside, one rounding to bf16 out (and for each gradient)
        return _sdpa_fallback(a.float(), b.float(), c.float(), bounds, scale, True, None, 0.0).to(a.dtype)

    go = torch.randn(1000, 8, 64, generator=g).to(torch.bfloat16)
    want = gc.fp32_reference(lambda a, b, c: _sdpa_fallback(a, b, c, cu, scale, True, None, 0.0), (q, k, v), go)
    for kernel, passes in ((fa2, True), (lambda a, b, c: fa2(a, b, c, [0, 1000]), False)):
        out = kernel(q, k, v)
        got = (out, *torch.autograd.grad(out, (q, k, v), go))
        ok, text = gc.verdict(got, want, torch.bfloat16)
        assert ok == passes, text
    bf16_fallback = _sdpa_fallback(q, k, v, cu, scale, True, None, 0.0)
    out = fa2(q, k, v)
    old_rule = max((a - b).abs().max().item() for a, b in zip(
        (out, *torch.autograd.grad(out, (q, k, v), go)),
        (bf16_fallback, *torch.autograd.grad(bf16_fallback, (q, k, v), go))))
    # what the bench used to compare: it failed this correct kernel where torch's bf16 SDPA on CPU rounds inside
    # (2.13); torch 2.7's accumulates in fp32 as the emulated kernel does, so there the two agree
    if Version(torch.__version__.split("+")[0]) >= Version("2.8"):
        assert old_rule > 2e-2


def test_gpu_check_prints_a_skipped_check():
    gc = _bench_gpu_check()
    line = gc.result_line({"family": "qwen2", "check": "rope.triton.bf16", "passed": True, "skipped": "no rotary",
                           "max_abs_diff": None, "tolerance": None, "error": None})
    assert line.startswith("[skip]") and "no rotary" in line
    line = gc.result_line({"family": "qwen2", "check": "x", "passed": False, "skipped": None,
                           "max_abs_diff": None, "tolerance": None, "error": "RuntimeError: no"})
    assert line.startswith("[FAIL]") and "n/a" in line


def test_flash_attn_deterministic_follows_transformers(monkeypatch):
    """transformers passes flash-attn's ``deterministic`` from FLASH_ATTENTION_DETERMINISTIC; tfcompat's call does
    too (it never passed it), and the call still binds to flash-attn 2's signature."""
    q, k, v, cu = _row()
    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    assert calls.deterministic() is False
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")
    assert calls.deterministic() is True
    args, kwargs = calls.flash_call(q, k, v, cu, 6, causal=True, scale=0.3, window=None, dropout_p=0.0,
                                    deterministic=calls.deterministic())
    assert kwargs["deterministic"] is True
    FLASH2.bind(*args, **kwargs)
    assert "deterministic" in calls._FLASH_NEEDS


def test_heads_the_kernels_do_not_take_are_not_a_failed_proof():
    """A v head_dim other than q's, or a head_dim over 256: the GPU kernels cannot take them, so the exact path
    serves them without a proof or a "please report" warning; the proof itself handles v's own head_dim."""
    import warnings

    import tfcompat
    from tfcompat._kernels import table  # private: the kernel and proof table is under test

    q, k, v, cu = _row(dim=8)
    assert calls.unfit_shapes(q, k, v) == ""
    assert "v head_dim 4" in calls.unfit_shapes(q, k, v[..., :4])
    big = torch.zeros(3, 2, 320)
    assert "over 256" in calls.unfit_shapes(big, big, big)
    tfcompat.clear_cache()
    v4 = v[..., :4].contiguous()

    def reference(a, b, c, bounds):
        return _sdpa_fallback(a, b, c, bounds, 0.3, True, None, 0.0)

    def kernel(a, b, c, cu_, longest):
        return _sdpa_fallback(a, b, c, cu_.tolist(), 0.3, True, None, 0.0)

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert proofs.proven("flash_attn", kernel, reference, q, k, v4, True, 0.3, None)
    assert [r["ok"] for r in table.proven()] == [True]
    tfcompat.clear_cache()


def test_public_varlen_attention_reads_no_boundaries_back_on_the_gpu_kernel_path():
    """The public varlen_attention with a GPU kernel, boundaries on the GPU and max_seqlen given reads nothing back
    to the host (the rule, a pure function of what a GPU call has); its device-side check accepts good boundaries
    and refuses every bad one by tfcompat's message, run here on CPU tensors where torch raises it at once."""
    from tfcompat.errors import PackingError
    from tfcompat.varlen import assert_cu_on_device, reads_bounds

    assert not reads_bounds("flash_attn", "cuda", 6) and not reads_bounds("torch_varlen", "cuda", 6)
    assert reads_bounds("flash_attn", "cuda", None)  # the longest must be read
    assert reads_bounds("sdpa", "cuda", 6)  # the SDPA path splits by Python ints
    assert reads_bounds("flash_attn", "cpu", 6)  # read for free, with a clear error
    total = 11
    assert_cu_on_device(torch.tensor([0, 4, 5, total], dtype=torch.int32), total, 6)
    for bad, longest in (([1, 4, 11], 7), ([0, 4, 10], 6), ([0, 6, 4, 11], 7), ([0, 4, 5, 11], 5),
                         ([0, 4, 5, 11], 7), ([0, 4, 4, 11], 7)):
        with pytest.raises(RuntimeError, match="tfcompat varlen_attention: cu_seqlens must run from 0"):
            assert_cu_on_device(torch.tensor(bad, dtype=torch.int32), total, longest)
    with pytest.raises(PackingError, match="1-D integer tensor"):
        assert_cu_on_device(torch.tensor([[0, 11]]), total, 11)
    with pytest.raises(PackingError, match="max_seqlen must be a positive int"):
        assert_cu_on_device(torch.tensor([0, 11]), total, 0)


def test_the_device_checks_fp32_comparison_runs_without_tf32():
    """check --device's fp32 packed-vs-padded comparison on a CUDA device runs with cuDNN and matmul TF32 off (the
    H200 run: glm_ocr's vision patch-embedding gradients moved by 1.5e-4 of their scale under PyTorch's default
    cuDNN TF32, upstream's own model too; 1.0e-6 without), and restores the user's settings after; on the CPU
    nothing changes."""
    from tfcompat._tools import device_checks  # private: the device checks' plan, run without a GPU

    def flags():
        return torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32

    before = flags()
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = True, True
    try:
        assert device_checks._fp32_exact("cuda:1", flags) == (False, False)
        assert flags() == (True, True)
        assert device_checks._fp32_exact("cpu", flags) == (True, True)
        with pytest.raises(ZeroDivisionError):
            device_checks._fp32_exact("cuda", lambda: 1 / 0)
        assert flags() == (True, True)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def test_every_device_side_check_message_fits_cuda():
    """torch._assert_async on CUDA refuses a message of 255 characters or more (the call itself fails: on an H200,
    torch 2.11, every fullgraph-compiled packed step did, on the traced step's 300-character messages). Every
    device-side check's message, read from the source with 24 characters for each interpolated value, fits; and
    the traced checks' helper refuses a longer one on every device."""
    import ast
    import pathlib

    import tfcompat
    from tfcompat._attention import starts as traced  # private: the traced step's device-side checks are under test

    def text(node):
        if isinstance(node, ast.Constant):
            return str(node.value)
        if isinstance(node, ast.JoinedStr):
            return "".join(text(v) if isinstance(v, ast.Constant) else "x" * 24 for v in node.values)
        if isinstance(node, ast.BinOp):
            return text(node.left) + text(node.right)
        raise AssertionError(f"a message built by {ast.dump(node)[:80]}: make it a literal or an f-string")

    prefix = len("tfcompat (checked inside torch.compile): ")
    found = []
    for path in pathlib.Path(tfcompat.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(getattr(node, "func", None), "attr", None) or getattr(getattr(node, "func", None), "id", "")
            if isinstance(node, ast.Call) and name in ("_assert", "_assert_async") and len(node.args) == 2:
                if isinstance(node.args[1], ast.Name):  # the helper's own call: checked below
                    continue
                size = len(text(node.args[1])) + (prefix if name == "_assert" else 0)
                found.append((f"{path.name}:{node.lineno}", size))
    assert len(found) >= 12, found
    assert not [f for f in found if f[1] > traced.ASSERT_MESSAGE_LIMIT], found
    with pytest.raises(AssertionError, match="over CUDA's 254"):
        traced._assert(torch.tensor(True), "x" * 250)
