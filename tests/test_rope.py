"""apply_rope against the installed transformers' own rotary application (the oracle)."""

import warnings

import pytest
import torch

from tfcompat.config import rope_parameters
from tfcompat.rope import apply_rope, apply_rope_
from tfcompat.testing import families

from _helpers import (
    BOUNDARY_ONLY,
    TOL,
    installed,
    modeling,
    one_per_rope_kernel,
    position_ids,
    rope_impls,
    rotary,
    rotary_families,
    said_if_not_served,
    triton_ready,
    upstream_rope,
)

SPECS = families(installed_only=False)  # the family facts, from the public face


# with triton (the interpreter environments) one family per kernel shape: the kernel sees the plan and widths,
# not the family; every family runs every other implementation in the same release's main environment
FAMILIES = one_per_rope_kernel(rotary_families()) if triton_ready() else rotary_families()
SHAPES = [(1, 1), (1, 7), (2, 33), (3, 65)]


def _inputs(name, batch, seq, dtype, layout, seed):
    g = torch.Generator().manual_seed(seed)
    rot, config = rotary(name)
    head_dim = rope_parameters(config).head_dim
    pos = position_ids(name, batch, seq, g)
    x = torch.zeros(1, dtype=dtype)
    cos, sin = rot(x, pos)
    shape_q = (batch, 4, seq, head_dim) if layout == 1 else (batch, seq, 4, head_dim)
    shape_k = (batch, 2, seq, head_dim) if layout == 1 else (batch, seq, 2, head_dim)
    q = torch.randn(shape_q, generator=g).to(dtype)
    k = torch.randn(shape_k, generator=g).to(dtype)
    return config, cos, sin, q, k, g


def _grads(fn, q, k, gq, gk):
    q = q.detach().clone().requires_grad_(True)
    k = k.detach().clone().requires_grad_(True)
    oq, ok = fn(q * 1, k * 1)  # a fresh non-leaf, as a projection output is
    torch.autograd.backward((oq, ok), (gq, gk))
    return oq.detach(), ok.detach(), q.grad, k.grad


# every shape in fp32; the half precisions (same kernels, other rounding) on the largest
DTYPE_SHAPES = [pytest.param(torch.float32, b, s, id=f"fp32-{b}-{s}") for b, s in SHAPES] + \
    [pytest.param(dt, *SHAPES[-1], id=f"{name}-{SHAPES[-1][0]}-{SHAPES[-1][1]}")
     for dt, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"))]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("dtype,batch,seq", DTYPE_SHAPES)
@pytest.mark.parametrize("layout", [1, 2], ids=["bhsd", "bshd"])
def test_apply_rope_matches_upstream_forward_and_backward(name, dtype, batch, seq, layout):
    config, cos, sin, q, k, g = _inputs(name, batch, seq, dtype, layout, seed=seq * 31 + batch)
    oracle = upstream_rope(name, config)
    gq = torch.randn(q.shape, generator=g).to(dtype)
    gk = torch.randn(k.shape, generator=g).to(dtype)
    want = _grads(lambda a, b: oracle(a, b, cos, sin, unsqueeze_dim=layout), q, k, gq, gk)
    candidates = {
        "upstream": lambda a, b: apply_rope(a, b, cos, sin, config=config, unsqueeze_dim=layout, impl="upstream"),
    }
    for impl in rope_impls():
        candidates[impl] = lambda a, b, impl=impl: apply_rope(a, b, cos, sin, config=config, unsqueeze_dim=layout,
                                                              impl=impl)
        candidates[impl + " in place"] = lambda a, b, impl=impl: apply_rope_(a, b, cos, sin, config=config,
                                                                             unsqueeze_dim=layout, impl=impl)
    for impl, fn in candidates.items():
        got = _grads(fn, q, k, gq, gk)
        for label, w, h in zip(("q", "k", "dq", "dk"), want, got):
            assert h.dtype == w.dtype and h.shape == w.shape, (impl, label)
            where = f"{name} {impl} {label}"
            torch.testing.assert_close(h, w, **TOL[dtype], msg=lambda m, where=where: f"{where}: {m}")


@pytest.mark.parametrize("name", FAMILIES)
def test_model_type_and_explicit_section_give_the_same_result(name):
    config, cos, sin, q, k, _ = _inputs(name, 2, 9, torch.float32, 1, seed=3)
    by_config = apply_rope(q, k, cos, sin, config=config)
    section = rope_parameters(config).mrope_section
    by_name = apply_rope(q, k, cos, sin, model_type=name, mrope_section=section)
    for a, b in zip(by_config, by_name):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", FAMILIES)
def test_rope_really_rotates(name):
    """Guard against a vacuous oracle: positions matter and norms are kept."""
    config, cos, sin, q, k, _ = _inputs(name, 1, 17, torch.float32, 1, seed=5)
    oq, ok = apply_rope(q, k, cos, sin, config=config)
    assert not torch.allclose(oq, q)
    torch.testing.assert_close(oq.norm(dim=-1), q.norm(dim=-1))


@pytest.mark.parametrize("name", FAMILIES)
def test_inplace_really_writes_into_q_and_k(name):
    config, cos, sin, q, k, _ = _inputs(name, 1, 5, torch.float32, 1, seed=9)
    q0, k0 = q.clone(), k.clone()
    oq, ok = apply_rope_(q, k, cos, sin, config=config)
    assert oq.data_ptr() == q.data_ptr() and ok.data_ptr() == k.data_ptr()
    want = apply_rope(q0, k0, cos, sin, config=config)
    torch.testing.assert_close(q, want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, want[1], rtol=1e-5, atol=1e-6)


def test_random_shapes_property():
    """Property-based: odd head counts, lengths and batch sizes, native vs upstream, fp32."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    names = FAMILIES

    @hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
    @hypothesis.given(name=st.sampled_from(names), batch=st.integers(1, 3), seq=st.integers(1, 40),
                      heads=st.integers(1, 5), seed=st.integers(0, 2**16))
    def check(name, batch, seq, heads, seed):
        g = torch.Generator().manual_seed(seed)
        rot, config = rotary(name)
        head_dim = rope_parameters(config).head_dim
        cos, sin = rot(torch.zeros(1), position_ids(name, batch, seq, g))
        q = torch.randn(batch, heads, seq, head_dim, generator=g)
        k = torch.randn(batch, 1, seq, head_dim, generator=g)
        want = upstream_rope(name, config)(q, k, cos, sin)
        got = apply_rope(q, k, cos, sin, config=config, impl="native")
        torch.testing.assert_close(got, want, **TOL[torch.float32])

    check()


def test_impl_env_variable(monkeypatch):
    name = FAMILIES[0]
    config, cos, sin, q, k, _ = _inputs(name, 1, 4, torch.float32, 1, seed=1)
    monkeypatch.setenv("TFCOMPAT_ROPE_IMPL", "upstream")
    apply_rope(q, k, cos, sin, config=config)
    monkeypatch.setenv("TFCOMPAT_ROPE_IMPL", "fastest")
    with pytest.raises(ValueError, match="TFCOMPAT_ROPE_IMPL='fastest' is not one of auto, native, composite, triton, "
                                         "upstream"):
        apply_rope(q, k, cos, sin, config=config)


@pytest.mark.parametrize("impl", rope_impls())
@pytest.mark.parametrize("name", FAMILIES)
def test_cos_and_sin_gradients_equal_upstreams(name, impl):
    """cos/sin that require grad (a learned or scaled rotary): their gradients equal upstream's element by
    element, not only in sum (the MLA families' cos holds cat(freqs, freqs): which half gets the gradient is
    the release's formula)."""
    config, cos, sin, q, k, _ = _inputs(name, 2, 6, torch.float32, 1, seed=2)
    weights = torch.linspace(-1, 1, q.numel()).view_as(q)

    def grads(fn):
        c, s = cos.clone().requires_grad_(True), sin.clone().requires_grad_(True)
        oq, ok = fn(q, k, c, s)
        ((oq * weights).sum() + (ok ** 2).sum()).backward()
        return oq.detach(), c.grad, s.grad

    want = grads(upstream_rope(name, config))
    with said_if_not_served(impl):
        got = grads(lambda a, b, c, s: apply_rope(a, b, c, s, config=config, impl=impl))
    for w, h, what in zip(want, got, ("q", "cos grad", "sin grad")):
        torch.testing.assert_close(h, w, rtol=1e-5, atol=1e-5, msg=lambda m, what=what: f"{name} {impl} {what}: {m}")


@pytest.mark.parametrize("impl", rope_impls())
@pytest.mark.parametrize("name", [n for n in ("qwen2_vl", "glm4v", "qwen3_5", "glm4", "glm4_moe_lite")
                                  if n in FAMILIES])
def test_inplace_on_projection_views_backpropagates_into_weights(name, impl):
    """The bundled attention rotates `proj(x).view(b, s, h, d).transpose(1, 2)` in place."""
    config, cos, sin, q, k, g = _inputs(name, 2, 11, torch.float32, 1, seed=4)
    b, h, s, d = q.shape
    x = torch.randn(b, s, 8, generator=g)
    w = torch.randn(8, h * d, generator=g, requires_grad=True)
    wk = torch.randn(8, k.shape[1] * d, generator=g, requires_grad=True)
    grads = []
    for fn in (lambda a, c: upstream_rope(name, config)(a, c, cos, sin),
               lambda a, c: apply_rope_(a, c, cos, sin, config=config, impl=impl)):
        qv = (x @ w).view(b, s, h, d).transpose(1, 2)
        kv = (x @ wk).view(b, s, -1, d).transpose(1, 2)
        oq, ok = fn(qv, kv)
        w.grad = wk.grad = None
        ((oq * oq.detach().sin()).sum() + (ok * 3).sum()).backward()
        grads.append((oq.detach(), w.grad.clone(), wk.grad.clone()))
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want, **TOL[torch.float32])


@BOUNDARY_ONLY
@pytest.mark.parametrize("name", [n for n in ("qwen2_vl", "glm4v", "qwen3_vl") if n in FAMILIES])
def test_torch_compile_fullgraph(name):
    import tfcompat
    from tfcompat.rope import prepare

    config, cos, sin, q, k, g = _inputs(name, 1, 9, torch.float32, 1, seed=6)
    tfcompat.clear_cache()
    cold = torch.compile(lambda a, b, c, s: apply_rope(a, b, c, s, config=config), fullgraph=True, backend="eager")
    # our message; torch.compile before 2.8 replaces it by a note naming the exception it met
    with pytest.raises(Exception, match=r"call tfcompat.rope.prepare\(|Variable\(TfcompatError\)"):
        cold(q, k, cos, sin)
    torch._dynamo.reset()
    prepare(config)
    fn = torch.compile(lambda a, b, c, s: apply_rope(a, b, c, s, config=config), fullgraph=True, backend="aot_eager")
    qq = q.clone().requires_grad_(True)
    got = fn(qq, k, cos, sin)
    got[0].sum().backward()
    want = upstream_rope(name, config)(q, k, cos, sin)
    torch.testing.assert_close(got[0].detach(), want[0], **TOL[torch.float32])
    torch.testing.assert_close(got[1], want[1], **TOL[torch.float32])
    ref = q.clone().requires_grad_(True)
    upstream_rope(name, config)(ref, k, cos, sin)[0].sum().backward()
    torch.testing.assert_close(qq.grad, ref.grad, **TOL[torch.float32])


@BOUNDARY_ONLY  # what torch's dynamo does (torch 2.7 and 2.13 environments), not what a release changes
@pytest.mark.parametrize("name", [n for n in ("qwen3", "qwen2_vl") if n in FAMILIES])
def test_explicit_triton_under_compile_says_the_composite_ran(name):
    """impl="triton" traced by torch.compile runs the composite (the compiler fuses it): said by a warning at trace
    time, with no graph break, and the numbers are upstream's (the kernel is never launched inside a graph)."""
    from tfcompat._rope import implementation  # private: the rotation's kernel choice is under test
    from tfcompat.rope import prepare

    config, cos, sin, q, k, g = _inputs(name, 2, 9, torch.float32, 1, seed=7)
    prepare(config)
    implementation._SAID.difference_update({m for m in implementation._SAID if "under torch.compile" in m})
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda a, b, c, s: apply_rope(a, b, c, s, config=config, impl="triton"))
    with pytest.warns(RuntimeWarning, match=rf"impl='triton'\) for {name} under torch.compile: the compiler traces"):
        out = explained(q, k, cos, sin)
    assert (out.graph_count, out.graph_break_count) == (1, 0)
    torch._dynamo.reset()
    fn = torch.compile(lambda a, b, c, s: apply_rope(a, b, c, s, config=config, impl="triton"), fullgraph=True,
                       backend="eager")
    got = fn(q, k, cos, sin)
    want = upstream_rope(name, config)(q, k, cos, sin)
    torch.testing.assert_close(got[0], want[0], **TOL[torch.float32])
    torch.testing.assert_close(got[1], want[1], **TOL[torch.float32])


def _dispatched(fn):
    """Non-view aten ops fn dispatches, and the host syncs among them (equal / _local_scalar_dense)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.syncs = [], []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            aten = torch.ops.aten
            if func in (aten.equal.default, aten._local_scalar_dense.default, aten.item.default):
                self.syncs.append(str(func))
            view = func is torch.ops.aten._unsafe_view.default or any(r.alias_info for r in func._schema.returns)
            if not func._schema.is_mutable and not view:
                self.ops.append(str(func.overloadpacket.__name__))
            return out

    with Count() as count:
        fn()
    return count.ops, count.syncs


@pytest.mark.parametrize("name", FAMILIES)
def test_composite_dispatches_few_ops_and_no_host_sync(name):
    """What CUDA tensors get where triton does not import: each op is a kernel launch there, and a host sync
    stalls the stream, so both are counted (upstream's count, printed beside it, is the yardstick)."""
    config, cos, sin, q, k, _ = _inputs(name, 2, 33, torch.bfloat16, 1, seed=8)
    upstream, _ = _dispatched(lambda: apply_rope(q, k, cos, sin, config=config, impl="upstream"))
    ops, syncs = _dispatched(lambda: apply_rope(q, k, cos, sin, config=config, impl="composite"))
    print(f"{name}: composite {len(ops)} ops, upstream {len(upstream)}")
    assert not syncs, f"{name}: the composite syncs with the host: {syncs}"
    # 10 (NeoX), 12 (GPT-J pairs, partial rotary, 3-row cos), 14 (GLM-4V 4.x: 3-row cos, pairs, partial): never
    # more than upstream's own function (10-16)
    assert len(ops) <= min(14, len(upstream)), \
        f"{name}: the composite dispatches {len(ops)} ops (upstream {len(upstream)}): {ops}"


@pytest.mark.skipif(not triton_ready(), reason="needs triton in its interpreter (TRITON_INTERPRET=1) or a GPU")
@pytest.mark.parametrize("name", FAMILIES)
def test_triton_is_one_launch_each_way(name):
    from tfcompat._rope import fused  # private: the Triton kernel is the room under test

    config, cos, sin, q, k, _ = _inputs(name, 2, 9, torch.bfloat16, 1, seed=8)
    q.requires_grad_(True)
    before = fused.launches
    oq, ok = apply_rope(q * 1, k, cos, sin, config=config, impl="triton")
    assert fused.launches == before + 1
    (oq.float().sum() + ok.float().sum()).backward()
    assert fused.launches == before + 2
    apply_rope_(q * 1, k * 1, cos, sin, config=config, impl="triton")  # in place, not views: one launch too
    assert fused.launches == before + 3


@pytest.mark.parametrize("qb,kb", [(2, 1), (1, 2)])
def test_q_and_k_of_different_batches_equal_upstream(qb, kb):
    """cos of batch 1 broadcasts over q's and k's batches in upstream's function; every impl computes the same
    (the fused Triton kernel walks q and k with one batch, so it hands such calls to the composite)."""
    name = next(n for n in FAMILIES if not SPECS[n].vision)
    config, cos, sin, q, k, g = _inputs(name, 1, 9, torch.float32, 1, seed=4)
    q, k = q.expand(qb, -1, -1, -1).contiguous(), k.expand(kb, -1, -1, -1).contiguous() + 1.0
    want = upstream_rope(name, config)(q, k, cos, sin)
    for impl in rope_impls():
        for fn in (apply_rope, apply_rope_):
            with said_if_not_served(impl):
                got = fn(q.clone(), k.clone(), cos, sin, config=config, impl=impl)
            for w, h in zip(want, got):
                torch.testing.assert_close(h, w, **TOL[torch.float32], msg=f"{impl} {fn.__name__}")


@pytest.mark.skipif(not triton_ready(), reason="needs triton in its interpreter (TRITON_INTERPRET=1) or a GPU")
def test_triton_launch_refuses_what_it_cannot_index():
    """The launch checks shapes, dtypes and devices itself: no call reaches the kernel with sizes it would
    read or write out of bounds, whoever calls it."""
    from tfcompat._rope import fused  # private: the Triton kernel is the room under test
    from tfcompat.errors import RopeShapeError

    name = next(n for n in FAMILIES if not SPECS[n].vision)
    config, cos, sin, q, k, _ = _inputs(name, 2, 9, torch.float32, 1, seed=2)
    layout = fused.Layout("neox", "", None)
    bad = [(q, k[:1]), (q, k[:, :, :5]), (q, k[..., :8]), (q, k.double())]
    for bq, bk in bad:
        with pytest.raises(RopeShapeError, match="nothing was launched"):
            fused.rope(bq, bk, cos, sin, layout, 2)
    with pytest.raises(RopeShapeError, match="nothing was launched"):
        fused.rope(q, k, cos[:, :5], sin[:, :5], layout, 2)


def test_triton_refuses_clearly_where_it_cannot_run():
    if triton_ready():
        pytest.skip("triton runs here")
    from tfcompat.errors import ConfigError

    config, cos, sin, q, k, _ = _inputs(FAMILIES[0], 1, 3, torch.float32, 1, seed=1)
    with pytest.raises(ConfigError, match="impl='triton'"):
        apply_rope(q, k, cos, sin, config=config, impl="triton")


def test_auto_is_device_aware():
    from tfcompat.rope import impl_for

    assert impl_for("cpu") == impl_for(torch.device("cpu")) == "native"
    try:
        import triton  # noqa: F401
        has_triton = True
    except ImportError:
        has_triton = False
    assert impl_for("cuda:0") == ("triton" if has_triton else "composite")
    assert impl_for("mps") == "composite"


@pytest.mark.parametrize("name", [n for n in installed() if SPECS[n].nope])
def test_nope_families_refuse_rope_by_name(name):
    """A decoder without rotary (GLM-5-Next): nothing to rotate, no RoPE parameters; report says so."""
    from tfcompat._probe import resolve as _resolve  # private: the resolutions are under test
    from tfcompat.errors import ConfigError
    from tfcompat.testing import tiny_config

    config = tiny_config(name)
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ConfigError, match=f"apply_rope for {name}: .*no rotary position embedding"):
        apply_rope(q, q.clone(), q[0], q[0], config=config)
    with pytest.raises(ConfigError, match=f"rope_parameters for {name}: .*no rotary position embedding"):
        rope_parameters(config)
    assert {r.impl for r in _resolve.report([name]) if r.capability.startswith("rope.") and ":" in r.capability} == \
        {"none"}


@pytest.mark.parametrize("impl", rope_impls())
def test_in_place_on_disjoint_slices_of_one_fused_projection(impl):
    """q and k cut from one fused QKV output share a storage but no element: rotated in place, exactly as
    upstream rotates copies of them; aliased q and k are still refused."""
    from tfcompat.errors import RopeShapeError

    name = next(n for n in FAMILIES if not SPECS[n].vision)
    config, cos, sin, q, k, _ = _inputs(name, 2, 9, torch.float32, 2, seed=6)  # (batch, seq, heads, dim)
    fused = torch.cat((q, k, k), dim=2)  # one projection output holding q, k and v heads
    want = upstream_rope(name, config)(q, k, cos, sin, unsqueeze_dim=2)
    fq, fk = fused[:, :, :4], fused[:, :, 4:6]
    got = apply_rope_(fq, fk, cos, sin, config=config, unsqueeze_dim=2, impl=impl)
    for w, h in zip(want, got):
        torch.testing.assert_close(h, w, **TOL[torch.float32])
    torch.testing.assert_close(fused[:, :, 6:], k)  # v untouched
    with pytest.raises(RopeShapeError, match="share memory"):
        apply_rope_(fused[:, :, :4], fused[:, :, 2:6], cos, sin, config=config, unsqueeze_dim=2, impl=impl)


@pytest.mark.parametrize("name", FAMILIES)
def test_double_backward_equals_upstream(name):
    """create_graph=True through the rotation (gradient penalties, Hessian-vector products): every impl's
    backward is itself differentiable, and the second-order gradients equal upstream's."""
    config, cos, sin, q, k, _ = _inputs(name, 2, 7, torch.float32, 1, seed=11)
    oracle = upstream_rope(name, config)

    def second_order(fn):
        a, b = q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)
        oq, ok = fn(a * 1, b * 1)
        ga, gb = torch.autograd.grad((oq ** 2).sum() + (ok ** 3).sum(), (a, b), create_graph=True)
        (ga.pow(2).sum() + gb.pow(2).sum()).backward()
        return a.grad, b.grad

    want = second_order(lambda a, b: oracle(a, b, cos, sin))
    for impl in rope_impls():
        got = second_order(lambda a, b, impl=impl: apply_rope(a, b, cos, sin, config=config, impl=impl))
        for w, h in zip(want, got):
            torch.testing.assert_close(h, w, rtol=1e-4, atol=1e-4, msg=lambda m, impl=impl: f"{name} {impl}: {m}")


@pytest.mark.parametrize("name", FAMILIES)
def test_other_call_shapes_of_upstreams_function(name):
    """Call shapes upstream's function takes beyond the 4-D layouts: Qwen4-Exp's indexer rotates (n, 1, d) keys
    with the (n, d) cos of one row; (seq, heads, d) with cos (seq, d) and unsqueeze_dim=1. Equal to upstream,
    forward and backward; shapes that cos would broadcast into something else are refused."""
    from tfcompat.errors import RopeShapeError

    config, cos, sin, q, k, g = _inputs(name, 1, 6, torch.float32, 1, seed=5)
    oracle = upstream_rope(name, config)
    one_row = (cos[:, 0], sin[:, 0]) if cos.dim() == 4 else (cos[0], sin[0])  # (3, n, d) or (n, d)
    keys = torch.randn(6, 1, q.shape[-1], generator=g)
    for a, b in ((keys, keys.flip(0)), (q[0].transpose(0, 1), k[0].transpose(0, 1))):  # (n, 1, d), (seq, heads, d)
        try:
            want = _grads(lambda x, y: oracle(x, y, *one_row), a, b, torch.ones_like(a), torch.ones_like(b))
        except (ValueError, RuntimeError) as exc:  # this release's function takes 4-D q only: a clear refusal
            with pytest.raises(RopeShapeError, match="own rotary function cannot take"):
                apply_rope(a, b, *one_row, config=config)
            print(f"upstream refuses {tuple(a.shape)}: {exc}")
            continue
        got = _grads(lambda x, y: apply_rope(x, y, *one_row, config=config), a, b, torch.ones_like(a),
                     torch.ones_like(b))
        for w, h in zip(want, got):
            torch.testing.assert_close(h, w, rtol=0, atol=0)
    with pytest.raises(RopeShapeError, match="does not broadcast to q"):
        apply_rope(q[0], k, cos, sin, config=config)  # (heads, seq, d) with batched cos: upstream adds a dim
    with pytest.raises(RopeShapeError, match="in place takes"):
        apply_rope_(keys.clone(), keys.clone(), *one_row, config=config)


@pytest.mark.skipif(not triton_ready(), reason="needs triton in its interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("name", FAMILIES)
def test_triton_gpu_tile_matches_upstream_interpreted(name, monkeypatch):
    """The interpreter groups rows in larger programs than a GPU launch does (it runs programs one at a time); here
    it runs the GPU's own tile (tools/compile_proof.py proves that one compiles without spills), forward and
    backward, bf16, in place and not, on every kernel shape: the tokens split over many programs (each looping over
    every q and k head), a partial last program and a partial-rotary tail copied in chunks."""
    from tfcompat._rope import fused  # private: the Triton kernel is the room under test

    monkeypatch.setattr(fused, "_INTERPRETER_PAIRS", fused._PAIRS)
    dtype, layout = torch.bfloat16, 2
    config, cos, sin, q, k, g = _inputs(name, 2, 33, dtype, layout, seed=7)
    oracle = upstream_rope(name, config)
    gq, gk = torch.randn(q.shape, generator=g).to(dtype), torch.randn(k.shape, generator=g).to(dtype)
    want = _grads(lambda a, b: oracle(a, b, cos, sin, unsqueeze_dim=layout), q, k, gq, gk)
    before = fused.launches
    for fn in (apply_rope, apply_rope_):
        got = _grads(lambda a, b, fn=fn: fn(a, b, cos, sin, config=config, unsqueeze_dim=layout, impl="triton"),
                     q, k, gq, gk)
        for label, w, h in zip(("q", "k", "dq", "dk"), want, got):
            where = f"{name} {fn.__name__} {label}"
            torch.testing.assert_close(h, w, **TOL[dtype], msg=lambda m, where=where: f"{where}: {m}")
    assert fused.launches == before + 4
    # the GPU tile split the tokens: several programs, each every head of its tokens (a (b, s, h, d) layout: the
    # sequence is dim 1), a partial last program (66 tokens)
    if cos.dim() == 3 and cos.shape[-1] <= q.shape[-1]:
        grid, _, meta = fused._plan(q, k, q, k, cos, sin, fused.Layout("neox", "", None), 1, False)
        assert meta["BLOCK_T"] * meta["BLOCK_HALF"] <= fused._PAIRS
        assert grid[0] > 2 or meta["BLOCK_HALF"] < 16  # a narrow partial rotary holds 66 tokens in one program
        assert grid[0] == -(-q.shape[0] * q.shape[1] // meta["BLOCK_T"])  # programs by tokens, not (token, head)


def _broken_launch(fused, monkeypatch, how):
    """A deliberately broken kernel: the real launch, then its output corrupted; or a launch that fails to compile."""
    real = fused._launch

    def launch(q, k, qo, ko, cos, sin, layout, seq_dim, inverse, plans=None):
        if how == "compile":
            raise RuntimeError("PTXASError: ptxas failed (a deliberately broken kernel)")
        real(q, k, qo, ko, cos, sin, layout, seq_dim, inverse, plans)
        with torch.no_grad():
            qo.add_(0.25)

    monkeypatch.setattr(fused, "_launch", launch)


@pytest.mark.skipif(not triton_ready(), reason="needs triton in its interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("how", ["wrong", "compile"])
def test_triton_first_use_proof_refuses_a_broken_kernel(how, monkeypatch):
    """impl='triton' asked by name: a kernel that fails its first-use proof raises before it computes anything;
    ``auto`` (the proof's other caller) falls back with one warning; both are listed as proven-and-failed."""
    import warnings

    from tfcompat import clear_cache
    from tfcompat._kernels import table  # private: the kernel and its proofs
    from tfcompat._rope import fused, fused_proof
    from tfcompat.errors import TfcompatError

    name = "qwen2"
    config, cos, sin, q, k, _ = _inputs(name, 2, 9, torch.float32, 1, seed=3)
    clear_cache()
    _broken_launch(fused, monkeypatch, how)
    before = (q.clone(), k.clone())
    with pytest.raises(TfcompatError, match="first-use proof on cpu") as err:
        apply_rope_(q, k, cos, sin, config=config, impl="triton")
    assert ("RuntimeError: PTXASError" if how == "compile" else "max |diff|") in str(err.value)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])  # nothing was computed with it
    layout = fused.Layout("neox", "", None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ok = [fused_proof.proven(q, k, cos, sin, layout, 2, False, "neox", "", explicit=False) for _ in range(3)]
    assert ok == [False] * 3
    assert len([w for w in seen if "failed its first-use proof" in str(w.message)]) == 1
    records = [r for r in table.proven() if r["kernel"] == "triton"]
    assert records and not any(r["ok"] for r in records)
    clear_cache()
    assert table.proven() == []


@pytest.mark.skipif(not triton_ready(), reason="needs triton in its interpreter (TRITON_INTERPRET=1)")
def test_triton_first_use_proof_runs_once_per_layout():
    from tfcompat import clear_cache
    from tfcompat._kernels import table  # private: the Triton kernel and its proofs are under test
    from tfcompat._rope import fused

    clear_cache()
    config, cos, sin, q, k, _ = _inputs("glm4", 2, 9, torch.bfloat16, 2, seed=4)
    before = fused.proof_launches
    for _ in range(3):
        apply_rope(q, k, cos, sin, config=config, unsqueeze_dim=2, impl="triton")
    apply_rope_(q.clone(), k.clone(), cos, sin, config=config, unsqueeze_dim=2, impl="triton")  # in place: its own
    records = [r for r in table.proven() if r["kernel"] == "triton"]
    assert len(records) == 2 and all(r["ok"] for r in records), records
    assert fused.proof_launches - before == 2 * 3  # per proof: forward; forward and backward with grads
    clear_cache()


@pytest.mark.skipif(not triton_ready(), reason="needs triton in its interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_triton_first_use_proof_under_generation_modes(mode):
    """generate() runs under no_grad, serving stacks under inference_mode: the proof (which differentiates its
    slice) passes there, and the call computes what upstream does."""
    from tfcompat import clear_cache
    from tfcompat._kernels import table  # private: the kernel and proof table is under test

    clear_cache()
    config, cos, sin, q, k, _ = _inputs("qwen2", 1, 5, torch.float32, 1, seed=5)
    oracle = upstream_rope("qwen2", config)
    with getattr(torch, mode)():
        got = apply_rope(q, k, cos, sin, config=config, impl="triton")
        want = oracle(q, k, cos, sin, unsqueeze_dim=1)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL[torch.float32])
    assert [r["ok"] for r in table.proven()] == [True]
    clear_cache()


def _edge_call(name, edge, g):
    """q, k, cos, sin of one edge call upstream's function takes or refuses (real cos/sin of the family)."""
    config, cos, sin, q, k, _ = _inputs(name, 1, 6, torch.float32, 1, seed=11)
    d = q.shape[-1]
    if edge == "bf16 q and k, fp32 cos":
        q, k = q.bfloat16(), k.bfloat16()
    elif edge == "fp32 q, fp16 k":
        k = k.half()
    elif edge == "k wider than cos":
        k = torch.randn(*k.shape[:-1], d + 2, generator=g)
    elif edge == "odd head_dim":
        q, k = (torch.randn(*t.shape[:-1], d + 1, generator=g) for t in (q, k))
    elif edge == "last stride 2":
        q, k = (torch.randn(*t.shape[:-1], 2 * d, generator=g)[..., ::2] for t in (q, k))
    elif edge == "odd slice offset":
        q, k = (torch.randn(*t.shape[:-1], d + 1, generator=g)[..., 1:] for t in (q, k))
    return config, q, k, cos, sin


EDGES = ["bf16 q and k, fp32 cos", "fp32 q, fp16 k", "k wider than cos", "odd head_dim", "last stride 2",
         "odd slice offset"]


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("name", FAMILIES)
def test_rope_edges_equal_upstream_or_refuse(name, edge):
    """Mixed dtypes (upstream's products promote), q or k wider than cos (a partial-rotary family passes the rest
    through, a full-rotary one raises), GPT-J pairs a complex view cannot see (odd head_dim or offset, last
    stride 2): every implementation returns upstream's tensors (dtype, shape, values) or raises
    RopeShapeError where upstream's own function raises; never a raw error or another dtype."""
    from tfcompat.errors import RopeShapeError

    config, q, k, cos, sin = _edge_call(name, edge, torch.Generator().manual_seed(2))
    try:
        want = upstream_rope(name, config)(q, k, cos, sin)
    except (RuntimeError, ValueError, IndexError) as exc:
        want = exc
    for impl in rope_impls() + ["upstream"]:
        if isinstance(want, Exception):
            with pytest.raises(RopeShapeError):
                apply_rope(q, k, cos, sin, config=config, impl=impl)
            continue
        with said_if_not_served(impl):
            got = apply_rope(q, k, cos, sin, config=config, impl=impl)
        for label, w, h in zip("qk", want, got):
            assert (h.dtype, h.shape) == (w.dtype, w.shape), (impl, label)
            where = f"{name} {edge} {impl} {label}"
            torch.testing.assert_close(h, w, **TOL[w.dtype], msg=lambda m, where=where: f"{where}: {m}")


@pytest.mark.parametrize("name", FAMILIES)
def test_backward_of_a_sum_equals_upstream(name):
    """``(q_out.sum() + k_out.sum()).backward()``: the gradients arrive expanded (stride 0 everywhere). GLM's GPT-J
    rotation on the native kernel used to raise torch's raw "last dimension with stride 1" there."""
    config, cos, sin, q, k, _ = _inputs(name, 2, 9, torch.float32, 1, seed=5)
    oracle = upstream_rope(name, config)

    def grads(fn):
        a, b = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        oq, ok = fn(a * 1, b * 1)
        (oq.sum() + ok.sum()).backward()
        return a.grad, b.grad

    want = grads(lambda a, b: oracle(a, b, cos, sin))
    for impl in rope_impls():
        got = grads(lambda a, b, impl=impl: apply_rope(a, b, cos, sin, config=config, impl=impl))
        for g, w, what in zip(got, want, ("q.grad", "k.grad")):
            torch.testing.assert_close(g, w, **TOL[torch.float32],
                                       msg=lambda m, impl=impl, what=what: f"{name} {impl} {what}: {m}")


@pytest.mark.parametrize("sections", ["one", "two", "three"])
@pytest.mark.parametrize("impl", rope_impls())
def test_every_section_list_upstream_accepts_equals_upstream(sections, impl):
    """Unfolded 3-row mRoPE cos with a section list of 1, 2 or 3 entries: upstream folds ``section * 2`` cycling
    T, H, W, so a list of 1 or 2 entries folds each half differently. Every impl equals upstream's function (the
    fused kernel folds 3 entries; it hands shorter lists to the composite, and says so when asked by name)."""
    name = next((n for n in FAMILIES if SPECS[n].vision and "apply_multimodal_rotary_pos_emb" in
                 vars(modeling(n))), None)
    if name is None:
        pytest.skip("no installed VL family keeps apply_multimodal_rotary_pos_emb")
    config, cos, sin, q, k, _ = _inputs(name, 2, 7, torch.float32, 1, seed=3)
    half = cos.shape[-1] // 2
    section = {"one": [half], "two": [half // 2, half - half // 2],
               "three": [half - 2 * (half // 4), half // 4, half // 4]}[sections]
    want = modeling(name).apply_multimodal_rotary_pos_emb(q, k, cos, sin, section)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = apply_rope(q, k, cos, sin, config=config, mrope_section=section, impl=impl)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL[torch.float32], msg=lambda m: f"{name} {impl} {section}: {m}")
    said = [str(w.message) for w in seen if "the composite computed it" in str(w.message)]
    assert bool(said) == (impl == "triton" and sections != "three"), said


def test_fused_qkv_slices_are_checked_on_their_layout_alone():
    """apply_rope_ refuses q and k that share an element; slices of one fused QKV buffer interleave without
    sharing one. The check reads the layout only (a CPU bitmap over the views' span, once per layout): meta
    tensors of a 7B-sized fused projection answer too (it allocated a bool buffer of the whole storage on q's
    device, and read it back, on every call)."""
    from tfcompat._rope.native import share_elements as _share_elements  # private: the layout rule

    for device in ("cpu", "meta"):
        qkv = torch.empty(1, 4096, (28 + 2 * 4) * 128, device=device).view(1, 4096, 36, 128)
        q, k, v = qkv[:, :, :28], qkv[:, :, 28:32], qkv[:, :, 32:]
        assert not _share_elements(q, k) and not _share_elements(k, v)
        assert _share_elements(qkv[:, :, :29], k)


@pytest.mark.skipif(not triton_ready(), reason="needs triton in its interpreter (TRITON_INTERPRET=1)")
def test_rope_triton_per_layer_calls(monkeypatch):
    """The patched model with the Triton RoPE kernel (TFCOMPAT_ROPE_IMPL=triton, in Triton's interpreter): the
    step's rotation keeps the launch plan the first layer made, so a layer makes at most 12 calls of tfcompat's
    host code (before: 24, the plan re-made per layer). The kernel's own body, which the interpreter runs as Python
    where a GPU runs it compiled, is not host code and is not counted."""
    import tfcompat
    from tfcompat._rope import fused  # private: the Triton kernel is the room under test
    from tfcompat.packing import pack
    from tfcompat.testing import tiny_model, tiny_sequence

    from _helpers import calls_per_layer

    monkeypatch.setenv("TFCOMPAT_ROPE_IMPL", "triton")
    kernel_bodies = {(f.fn.__code__.co_filename, f.fn.__name__) for f in vars(fused).values()
                     if hasattr(f, "fn") and hasattr(f, "run")}  # @triton.jit functions
    assert len(kernel_bodies) >= 4, "the Triton kernels are not found as jit functions"
    rows = [tiny_sequence("qwen2", text=7), tiny_sequence("qwen2", text=4)]
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    pk = pack(ids, mask)
    before = fused.launches

    def build(layers):
        model = tiny_model("qwen2", num_hidden_layers=layers)
        tfcompat.patch(model)
        return model

    per_layer, counts = calls_per_layer(build, dict(input_ids=pk.input_ids, position_ids=pk.position_ids,
                                                    use_cache=False), kernel_bodies)
    assert fused.launches > before, "the Triton kernel did not run"
    assert per_layer["tfcompat"] <= 12, f"{per_layer['tfcompat']} tfcompat calls per layer ({counts})"
