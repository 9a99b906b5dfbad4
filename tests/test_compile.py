"""torch.compile over a patched model as users compile it: per decoder layer (the FSDP2 recipe's
``layer.compile()``), across training steps whose packed boundaries differ as every step's do. Counted with
torch's own counting backend over AOT autograd, against the unpatched model compiled the same way on padded
batches of the same rows; compiled equals eager, forward and backward.
"""

import logging

import pytest
import torch
import transformers

import tfcompat
from tfcompat.errors import TfcompatError
from tfcompat.packing import pack, unpack

from _helpers import COMPILES, TORCH_DECIDES, close_to_model, grads_by_name, param_grads, patchable
from _models import padded, text_model, tiny_model

pytestmark = COMPILES
NAMES = [n for n in ("qwen2", "qwen3", "qwen2_5_vl") if n in patchable()]
STEPS = 8


def _rows(step):
    g = torch.Generator().manual_seed(step)
    count = int(torch.randint(1, 5, (1,), generator=g))
    return [torch.randint(5, 60, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (count,), generator=g)]


class _LimitHit(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        if "recompile_limit" in record.getMessage() or "cache_size_limit" in record.getMessage():
            self.messages.append(record.getMessage())


def _run_steps(name, patched, layers, compiled):
    """Logits and parameter gradients of STEPS steps (each its own rows), and the graphs compiled."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = tiny_model(name, num_hidden_layers=layers)
    model.train()
    if patched:
        tfcompat.patch(model)
    counter = CompileCounterWithBackend("aot_eager")
    if compiled:
        for layer in text_model(model).layers:
            layer.compile(backend=counter)
    outs = []
    for step in range(STEPS):
        ids, mask = padded(_rows(step))
        if patched:
            pk = pack(ids, mask)
            logits = unpack(model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False).logits, pk)
        else:
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        (logits * mask[..., None]).sum().backward()
        outs.append((logits.detach()[mask.bool()], param_grads(model)))
        model.zero_grad()
    return outs, counter.frame_count


#: graphs the patched model may compile beyond the unpatched one: none; torch 2.7's dynamo guards every field of the
#: step it is handed (its boundaries as Python ints, so one graph per sequence count: 6 vs 4 on 4.51.3, measured)
SLACK = 0 if tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 8) else 2

#: 28 layers (a 0.5B-7B model's depth) on one family; the others with 10, past dynamo's recompile limit (8): a
#: forward guarded per layer reaches it either way (compile time grows with the layers: ~45 s for 28 on 2 cores)
LAYERS = {NAMES[0]: 28} if "qwen3" not in NAMES else {"qwen3": 28}


@pytest.mark.parametrize("name", NAMES)
def test_per_layer_compile_compiles_like_upstream(name):
    """28 layers (10 on the other families), 8 steps of different boundaries and sequence counts: no more graphs
    than the unpatched model (:data:`SLACK`), no recompile-limit warning (each layer's forward used to be its own
    guarded object: 8 graphs, then dynamo gave up and ran the rest eagerly), and compiled equals eager."""
    layers = LAYERS.get(name, 10)
    hit = _LimitHit()
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(hit)
    try:
        got, graphs = _run_steps(name, True, layers, True)
        _, plain_graphs = _run_steps(name, False, layers, True)
    finally:
        logger.removeHandler(hit)
        torch._dynamo.reset()
    assert not hit.messages, hit.messages
    print(f"{name}: {graphs} graphs patched, {plain_graphs} unpatched")
    assert graphs <= plain_graphs + SLACK, (graphs, plain_graphs)
    want, _ = _run_steps(name, True, layers, False)
    for step, ((g_logits, g_grads), (w_logits, w_grads)) in enumerate(zip(got, want)):
        # the whole-model tolerance: compiled, the SDPA path is one masked call where eager runs one per sequence
        close_to_model(g_logits, w_logits, f"{name} step {step} logits")
        for key, g, w in grads_by_name(g_grads, w_grads, f"{name} step {step}"):
            close_to_model(g, w, f"{name} step {step} {key}")


# --- the whole model, fullgraph=True ---------------------------------------------------------------------------

#: the text families and one VL family (a text-only step's towers tie in without a graph break)
WHOLE = [n for n in ("qwen2", "qwen2_5_vl") if n in patchable()]
WHOLE_STEPS = 3
#: torch 2.7's dynamo cannot build the step's carrier (a tuple subclass: ``_RotaryWithStep``) inside the graph, so the
#: whole model compiles there only with graph breaks (fullgraph=False, eager-exact); measured on 2.7.1 and 2.13.0
#: (2.8-2.12 are not in the matrix)
FULLGRAPH = pytest.mark.skipif(tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 8),
                               reason="fullgraph=True over the whole patched model needs torch >= 2.8")


def _collated(step):
    """The step's rows as transformers' DataCollatorWithFlattening(return_flash_attn_kwargs=True) gives them."""
    import inspect

    from transformers import DataCollatorWithFlattening

    if "return_flash_attn_kwargs" not in inspect.signature(DataCollatorWithFlattening.__init__).parameters:
        pytest.skip(f"transformers {transformers.__version__}'s DataCollatorWithFlattening has no "
                    f"return_flash_attn_kwargs (added in 4.52)")
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    return collator([{"input_ids": r} for r in _rows(step)])


def _padded_labels(ids, mask):
    return ids.masked_fill(mask == 0, -100)


def _whole(name, mode, patched, compiled):
    """Per step: the loss (or the logits' sum where no labels ride the call), the real tokens' logits and the
    parameter gradients; and the graphs compiled. ``mode``: "padded" (a padded batch with attention_mask: the
    documented upstream path), "positions" (one packed row of position ids), "collator" (the collator's batch:
    cu_seq_lens / max_length kwargs and labels)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(name, num_hidden_layers=2)
    model.train()
    if patched:
        tfcompat.patch(model)
    counter = CompileCounterWithBackend("aot_eager")
    run = torch.compile(model, backend=counter, fullgraph=True) if compiled else model
    outs = []
    for step in range(WHOLE_STEPS):
        ids, mask = padded(_rows(step))
        if mode == "padded" or not patched:
            out = run(input_ids=ids, attention_mask=mask, labels=_padded_labels(ids, mask), use_cache=False)
            logits = out.logits[mask.bool()]
        elif mode == "positions":
            pk = pack(ids, mask)
            out = run(input_ids=pk.input_ids, position_ids=pk.position_ids, labels=pk.input_ids, use_cache=False)
            logits = out.logits[0]
        else:
            out = run(**_collated(step), use_cache=False)
            logits = out.logits[0]
        out.loss.backward()
        outs.append((out.loss.detach(), logits.detach(), param_grads(model)))
        model.zero_grad()
    breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    return outs, counter.frame_count, breaks


#: every way of giving the rows on the text family; the VL family (towers tied in) on packed position ids
WHOLE_CASES = [(WHOLE[0], m) for m in ("padded", "positions", "collator")] + [(n, "positions") for n in WHOLE[1:]]


@FULLGRAPH
@pytest.mark.parametrize(("name", "mode"), WHOLE_CASES)
def test_fullgraph_whole_model(name, mode):
    """``torch.compile(model, fullgraph=True)`` over the patched model, 4 steps of different boundaries: it
    compiles (it used to fail on data-dependent guards and host reads: ``starts_of``, ``mask_valid``, the
    remembered kwargs), with no more graphs than the unpatched model, and compiled equals eager, loss,
    logits and gradients. The packed modes' eager run is the patched model, which the other tests hold to the
    unpatched model on the padded batch; that oracle is asserted here too for the loss."""
    got, graphs, breaks = _whole(name, mode, True, True)
    _, plain_graphs, plain_breaks = _whole(name, mode, False, True)
    assert breaks == plain_breaks == 0
    print(f"{name} {mode}: {graphs} graphs patched, {plain_graphs} unpatched")
    assert graphs <= plain_graphs, (graphs, plain_graphs)
    want, _, _ = _whole(name, mode, True, False)
    upstream, _, _ = _whole(name, mode, False, False)
    for step, (g, w, u) in enumerate(zip(got, want, upstream)):
        close_to_model(g[0], w[0], f"{name} {mode} step {step} loss")
        close_to_model(g[0], u[0], f"{name} {mode} step {step} loss against the unpatched padded batch")
        close_to_model(g[1], w[1], f"{name} {mode} step {step} logits")
        for key, a, b in grads_by_name(g[2], w[2], f"{name} {mode} step {step}"):
            close_to_model(a, b, f"{name} {mode} step {step} {key}")


_IDS = torch.arange(5, 14)[None]
_CU = torch.tensor([0, 3, 9], dtype=torch.int32)
BAD_UNDER_COMPILE = {
    "positions going down": dict(position_ids=torch.tensor([[0, 1, 2, 3, 5, 4, 0, 1, 2]])),
    "cu against positions": dict(position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]]), cu_seq_lens_q=_CU,
                                 cu_seq_lens_k=_CU, max_length_q=6, max_length_k=6),
    "cu short of the row": dict(position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5]]),
                                cu_seq_lens_q=_CU.clamp(max=8), cu_seq_lens_k=_CU.clamp(max=8), max_length_q=6,
                                max_length_k=6),
    "max_length against cu": dict(position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5]]), cu_seq_lens_q=_CU,
                                  cu_seq_lens_k=_CU, max_length_q=4, max_length_k=4),
    "packed row beside a mask": dict(position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5]]),
                                     attention_mask=torch.ones(1, 9, dtype=torch.long)),
}


@FULLGRAPH
@pytest.mark.parametrize("case", sorted(BAD_UNDER_COMPILE))
def test_fullgraph_fails_closed(case):
    """A bad row still fails closed inside the compiled graph: an assertion that names tfcompat's check (a
    device-side assert, no host read) or a TfcompatError, never a raw dynamo error or a silent number."""
    torch._dynamo.reset()
    model = tiny_model(WHOLE[0], num_hidden_layers=1)
    tfcompat.patch(model)
    run = torch.compile(model, backend="aot_eager", fullgraph=True)
    try:
        with pytest.raises((RuntimeError, TfcompatError)) as err:
            run(input_ids=_IDS, use_cache=False, **BAD_UNDER_COMPILE[case])
    finally:
        torch._dynamo.reset()
    assert isinstance(err.value, TfcompatError) or \
        str(err.value).startswith("tfcompat (checked inside torch.compile)"), str(err.value)[:500]


@pytest.mark.parametrize("fullgraph", [False, pytest.param(True, marks=FULLGRAPH)], ids=["whole", "fullgraph"])
@pytest.mark.parametrize("name", WHOLE)  # a text family and a VL family (the VL one counts positions from cu)
def test_compiled_eval_packed_row_with_the_configs_use_cache(name, fullgraph):
    """``model.eval()`` and a packed row with ``use_cache`` left to the config (True): eagerly the row runs packed;
    compiled it did too only with ``use_cache=False`` (inside a graph the default counted as a prefill and a
    device-side check refused the row). Given as position ids or as cu kwargs alone (a VL model's positions are
    counted from them inside the graph); the oracle: the unpatched model on the padded batch."""
    torch._dynamo.reset()
    model = tiny_model(name, num_hidden_layers=2).eval()
    ids, mask = padded(_rows(3))
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    tfcompat.patch(model)
    pk = pack(ids, mask, vision=False)
    run = torch.compile(model, backend="aot_eager", fullgraph=fullgraph)
    calls = {"positions": dict(position_ids=pk.position_ids),
             "cu": dict(cu_seq_lens_q=pk.cu_seqlens, cu_seq_lens_k=pk.cu_seqlens, max_length_q=pk.max_seqlen,
                        max_length_k=pk.max_seqlen)}
    try:
        for how, kw in calls.items():
            with torch.no_grad():
                got = unpack(run(input_ids=pk.input_ids, **kw).logits, pk)[mask.bool()]
            close_to_model(got, want, f"{name} compiled eval, {how}")
    finally:
        torch._dynamo.reset()


@FULLGRAPH
def test_fullgraph_decoding_with_a_cache():
    """A compiled rollout's calls: a prefill that fills a KV cache and a decoding step, batch 1, position ids and
    no attention_mask, run upstream's path (one sequence with a cache: the compiled step used to take it for a
    packed row and refuse it) and equal the unpatched model; a packed row with a cache still fails closed (a
    packed row with ``use_cache=True`` and no cache makes none, as eagerly)."""
    ids = torch.arange(5, 12)[None]
    got = {}
    for patched in (False, True):
        torch._dynamo.reset()
        model = tiny_model(WHOLE[0], num_hidden_layers=2)
        model.eval()
        if patched:
            tfcompat.patch(model)
        run = torch.compile(model, backend="aot_eager", fullgraph=True)
        with torch.no_grad():
            first = run(input_ids=ids, position_ids=torch.arange(7)[None], use_cache=True)
            step = run(input_ids=torch.tensor([[13]]), position_ids=torch.tensor([[7]]),
                       past_key_values=first.past_key_values, use_cache=True)
        got[patched] = (first.logits, step.logits)
        if patched:
            with torch.no_grad(), pytest.raises((RuntimeError, TfcompatError)) as err:
                run(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]]),
                    past_key_values=first.past_key_values, use_cache=True)
            assert isinstance(err.value, TfcompatError) or \
                str(err.value).startswith("tfcompat (checked inside torch.compile)"), str(err.value)[:500]
    torch._dynamo.reset()
    for g, w, what in zip(got[True], got[False], ("prefill", "decoding step")):
        close_to_model(g, w, f"compiled {what} with a cache")


# --- a proven GPU kernel under compile: called in the graph as its registered op -------------------------------
# A stand-in for torch's varlen_attn, registered through torch.library as the real one is (a custom op with a fake
# and an autograd formula), exact on the CPU: per-sequence SDPA read from cu inside the op (opaque to dynamo)


def _stand_in_pieces(q, k, v, cu, scale, left):
    """Per sequence: (slice, q, k and v with kv heads repeated to q's (heads, n, d), the softmax probabilities)."""
    bounds = cu.tolist()
    rep = q.shape[1] // k.shape[1]
    for a, b in zip(bounds[:-1], bounds[1:]):
        i = torch.arange(b - a)
        dist = i[:, None] - i[None, :]
        mask = (dist >= 0) & ((dist <= left) if left >= 0 else True)
        qs = q[a:b].transpose(0, 1)
        ks, vs = (t[a:b].transpose(0, 1).repeat_interleave(rep, 0) for t in (k, v))
        p = ((qs @ ks.transpose(1, 2)) * scale).masked_fill(~mask, float("-inf")).softmax(-1)
        yield slice(a, b), qs, ks, vs, p


def _stand_in_attention(q, k, v, cu, scale, left):
    return torch.cat([(p @ vs).transpose(0, 1) for _, _, _, vs, p in _stand_in_pieces(q, k, v, cu, scale, left)])


def _stand_in_grads(grad, q, k, v, cu, scale, left):
    """The attention backward by its formulas (a custom op's body runs below autograd)."""
    rep = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for at, qs, ks, vs, p in _stand_in_pieces(q, k, v, cu, scale, left):
        go = grad[at].transpose(0, 1)
        dp = go @ vs.transpose(1, 2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
        dq[at] = (ds @ ks).transpose(0, 1)
        kv_heads = k.shape[1]
        dk[at] = (ds.transpose(1, 2) @ qs).reshape(kv_heads, rep, -1, q.shape[2]).sum(1).transpose(0, 1)
        dv[at] = (p.transpose(1, 2) @ go).reshape(kv_heads, rep, -1, q.shape[2]).sum(1).transpose(0, 1)
    return dq, dk, dv


@torch.library.custom_op("tfcompat_stand_in::varlen_fwd", mutates_args=())
def _stand_in_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                  scale: float, left: int) -> torch.Tensor:
    assert max_len == max(b - a for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:]))
    return _stand_in_attention(q, k, v, cu, scale, left).contiguous()


@_stand_in_fwd.register_fake
def _(q, k, v, cu, max_len, scale, left):
    return torch.empty_like(q)


@torch.library.custom_op("tfcompat_stand_in::varlen_bwd", mutates_args=())
def _stand_in_bwd(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                  scale: float, left: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _stand_in_grads(grad, q, k, v, cu, scale, left)


@_stand_in_bwd.register_fake
def _(grad, q, k, v, cu, scale, left):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _stand_in_setup(ctx, inputs, output):
    q, k, v, cu, _, scale, left = inputs
    ctx.save_for_backward(q, k, v, cu)
    ctx.scale, ctx.left = scale, left


def _stand_in_backward(ctx, grad):
    q, k, v, cu = ctx.saved_tensors
    return (*_stand_in_bwd(grad, q, k, v, cu, ctx.scale, ctx.left), None, None, None, None)


_stand_in_fwd.register_autograd(_stand_in_backward, setup_context=_stand_in_setup)


def _stand_in_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None,
                          window_size=(-1, -1), enable_gqa=False):
    """torch's varlen_attn's call (torch 2.13), causal only (window_size (left, 0))."""
    assert window_size[1] == 0 and cu_seq_q is cu_seq_k and max_q == max_k
    return _stand_in_fwd(query, key, value, cu_seq_q, max_q, scale, window_size[0])


def _graph_recorder(graphs):
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


def _targets(graphs):
    return [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]


@FULLGRAPH
@TORCH_DECIDES  # torch's op registration and tracing; the model code's graphs are counted above
def test_a_kernel_proven_before_compiling_is_the_op_the_graph_calls(monkeypatch):
    """``tfcompat.warmup`` proves the GPU varlen kernel outside any graph (here a stand-in for torch's varlen_attn,
    registered through torch.library on the CPU as the real one is); the fullgraph-compiled model over the
    collator's kwargs (cu_seq_lens, max_length) then calls that op in its forward and backward graphs, not SDPA,
    and compiled equals eager. Traced before any proof, the graph runs SDPA and a warning says to warm up."""
    from tfcompat._attention import kernels as varlen
    from tfcompat._kernels import table

    monkeypatch.setattr(varlen, "_kind", lambda q, dropout_p: "torch_varlen")
    monkeypatch.setattr(varlen._choice, "torch_varlen", lambda: _stand_in_varlen_attn)
    monkeypatch.setattr(table, "SAID", set())
    name = WHOLE[0]

    def run(compiled, warm):
        tfcompat.clear_cache()
        torch._dynamo.reset()
        model = tiny_model(name, num_hidden_layers=2)
        model.train()
        tfcompat.patch(model)
        if warm:
            # a step of 3 sequences (one sequence runs upstream's own path eagerly: no packed attention to prove)
            records = tfcompat.warmup(model, dict(_collated(3), use_cache=False))
            assert [(r["kernel"], r["ok"]) for r in records if r["op"] == "varlen"] == [("torch_varlen", True)]
        graphs = []
        call = torch.compile(model, backend=_graph_recorder(graphs), fullgraph=True) if compiled else model
        outs = []
        for step in range(WHOLE_STEPS):
            out = call(**_collated(step), use_cache=False)
            out.loss.backward()
            outs.append((out.loss.detach(), out.logits.detach(), param_grads(model)))
            model.zero_grad()
        torch._dynamo.reset()
        return outs, _targets(graphs)

    got, targets = run(True, True)
    assert targets.count("tfcompat_stand_in.varlen_fwd.default") >= 2, targets  # both layers of every graph
    assert "tfcompat_stand_in.varlen_bwd.default" in targets
    assert not [t for t in targets if "scaled_dot_product" in t or "flash_attention" in t], targets
    want, _ = run(False, True)
    for step, (g, w) in enumerate(zip(got, want)):
        close_to_model(g[0], w[0], f"step {step} loss")
        close_to_model(g[1], w[1], f"step {step} logits")
        for key, a, b in grads_by_name(g[2], w[2], f"step {step}"):
            close_to_model(a, b, f"step {step} {key}")
    with pytest.warns(RuntimeWarning, match=r"tfcompat.warmup\(model, example\)"):
        cold, cold_targets = run(True, False)
    assert "tfcompat_stand_in.varlen_fwd.default" not in cold_targets
    assert [t for t in cold_targets if "scaled_dot_product" in t or "flash_attention" in t]
    for step, (g, w) in enumerate(zip(cold, want)):
        close_to_model(g[0], w[0], f"cold step {step} loss")


def test_warmup_runs_eagerly_and_leaves_the_gradients():
    """``tfcompat.warmup`` on a compiled model compiles nothing (it runs eagerly: a proof cannot run in a graph),
    leaves every parameter's gradient as it was, and refuses an example that is not the forward's kwargs."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = tiny_model(WHOLE[0], num_hidden_layers=1)
    model.train()
    tfcompat.patch(model)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    pk = pack(*padded(_rows(3)))
    assert tfcompat.warmup(compiled, {"input_ids": pk.input_ids, "position_ids": pk.position_ids}) == []
    assert counter.frame_count == 0
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(TfcompatError, match="example must be a dict"):
        tfcompat.warmup(model, pk.input_ids)
    torch._dynamo.reset()


@FULLGRAPH
def test_the_real_torch_varlen_call_traces_as_its_op():
    """tfcompat's call of the installed torch's own varlen_attn (the GPU path) traces under fullgraph=True into
    torch's registered op (``torch_attn._varlen_attn``), traced here on the CPU with a backend that records the
    graph and runs nothing (the op has no CPU kernel). On an H200 (torch 2.11) the call's read of varlen_attn's
    keywords from torch's file stopped the trace ("Attempted to call function marked as skipped")."""
    from tfcompat._attention import kernels as varlen  # the kernels of packed attention (the room under test)

    if not varlen._choice.torch_ships("nn/attention/varlen.py"):
        pytest.skip(f"torch {torch.__version__} ships no torch.nn.attention.varlen")
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return lambda *args: [torch.zeros(16, 4, 32)]

    q, k = torch.randn(16, 4, 32), torch.randn(16, 2, 32)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    torch._dynamo.reset()
    try:
        torch.compile(lambda a, b, c, d: varlen._gpu_call("torch_varlen", a, b, c, d, 8, True, 0.1, None, 0.0),
                      fullgraph=True, backend=record)(q, k, k, cu)
    finally:
        torch._dynamo.reset()
    assert "torch_attn._varlen_attn" in _targets(graphs), _targets(graphs)


@FULLGRAPH
def test_the_flash_attn_call_traces_once_looked_up(monkeypatch):
    """tfcompat's flash-attn call under fullgraph=True reads the function an eager call looked up (here a
    stand-in: flash-attn does not install on these machines); the look-up itself is never traced (dynamo: "Import
    failure" where flash-attn does not import)."""
    from tfcompat._attention import kernels as varlen  # the kernels of packed attention (the room under test)

    seen = []

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        seen.append(sorted(kwargs))
        return q * 2

    monkeypatch.setattr(varlen._choice, "_FLASH", stand_in)
    q, k = torch.randn(16, 4, 32), torch.randn(16, 2, 32)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    torch._dynamo.reset()
    try:
        out = torch.compile(lambda a, b, c: varlen._gpu_call("flash_attn", a, b, b, c, 8, True, 0.1, None, 0.0),
                            fullgraph=True, backend="eager")(q, k, cu)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(out, q * 2)
    assert seen == [["causal", "deterministic", "dropout_p", "softmax_scale", "window_size"]]


@TORCH_DECIDES  # torch's op registration and tracing; the model code's graphs are counted above
def test_compiled_layers_call_the_kernel_proven_before_compiling(monkeypatch):
    """The FSDP2 recipe (``layer.compile()`` on every decoder layer, the step decided eagerly outside them) after
    ``tfcompat.warmup``: the layers' graphs call the proven kernel's registered op (the stand-in for torch's
    varlen_attn), not SDPA, and compiled equals eager, across steps of different boundaries; compiled before any
    proof, they run SDPA and a warning says to warm up (no proof is traced into the graph)."""
    from tfcompat._attention import kernels as varlen
    from tfcompat._kernels import table

    monkeypatch.setattr(varlen, "_kind", lambda q, dropout_p: "torch_varlen")
    monkeypatch.setattr(varlen._choice, "torch_varlen", lambda: _stand_in_varlen_attn)
    monkeypatch.setattr(table, "SAID", set())

    def run(compiled, warm=True):
        tfcompat.clear_cache()
        torch._dynamo.reset()
        model = tiny_model(WHOLE[0], num_hidden_layers=2)
        model.train()
        tfcompat.patch(model)
        if warm:
            pk = pack(*padded(_rows(3)))
            tfcompat.warmup(model, {"input_ids": pk.input_ids, "position_ids": pk.position_ids})
        graphs = []
        if compiled:
            for layer in text_model(model).layers:
                layer.compile(backend=_graph_recorder(graphs))
        outs = []
        for step in (3, 4, 5):
            ids, mask = padded(_rows(step))
            pk = pack(ids, mask)
            logits = unpack(model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False).logits, pk)
            (logits * mask[..., None]).sum().backward()
            outs.append((logits.detach()[mask.bool()], param_grads(model)))
            model.zero_grad()
        torch._dynamo.reset()
        return outs, _targets(graphs)

    got, targets = run(True)
    assert "tfcompat_stand_in.varlen_fwd.default" in targets and "tfcompat_stand_in.varlen_bwd.default" in targets
    assert not [t for t in targets if "scaled_dot_product" in t or "flash_attention" in t], targets
    want, _ = run(False)
    for step, ((g, gg), (w, wg)) in enumerate(zip(got, want)):
        close_to_model(g, w, f"step {step} logits")
        for key, a, b in grads_by_name(gg, wg, f"step {step}"):
            close_to_model(a, b, f"step {step} {key}")
    with pytest.warns(RuntimeWarning, match=r"tfcompat.warmup\(model, example\)"):
        cold, cold_targets = run(True, warm=False)
    assert "tfcompat_stand_in.varlen_fwd.default" not in cold_targets
    # SDPA (torch 2.7's AOT graph holds its decomposition: a softmax)
    assert [t for t in cold_targets if "scaled_dot_product" in t or "softmax" in t]
    for step, ((g, _), (w, _)) in enumerate(zip(cold, want)):
        close_to_model(g, w, f"cold step {step} logits")
