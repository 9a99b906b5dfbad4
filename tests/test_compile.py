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

from _helpers import BOUNDARY_ONLY, close_to_model, grads_by_name, param_grads, patchable
from _models import padded, text_model, tiny_model

pytestmark = BOUNDARY_ONLY
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


#: 28 layers (a 0.5B-7B model's depth) on one family; the others with 10, past dynamo's recompile limit (8): a
#: forward guarded per layer reaches it either way (compile time grows with the layers: ~45 s for 28 on 2 cores)
LAYERS = {NAMES[0]: 28} if "qwen3" not in NAMES else {"qwen3": 28}


@pytest.mark.parametrize("name", NAMES)
def test_per_layer_compile_compiles_like_upstream(name):
    """28 layers (10 on the other families), 8 steps of different boundaries and sequence counts: at most the
    unpatched model's graphs plus 2, no recompile-limit warning (each layer's forward used to be its own guarded
    object: 8 graphs, then dynamo gave up and ran the rest eagerly), and compiled equals eager."""
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
    assert graphs <= plain_graphs + 2, (graphs, plain_graphs)
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
#: torch 2.7's dynamo cannot build the step's carrier (a tuple subclass: ``_Carried``) inside the graph, so the
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
    remembered kwargs), with at most the unpatched model's graphs plus 2, and compiled equals eager, loss,
    logits and gradients. The packed modes' eager run is the patched model, which the other tests hold to the
    unpatched model on the padded batch; that oracle is asserted here too for the loss."""
    got, graphs, breaks = _whole(name, mode, True, True)
    _, plain_graphs, plain_breaks = _whole(name, mode, False, True)
    assert breaks == plain_breaks == 0
    assert graphs <= plain_graphs + 2, (graphs, plain_graphs)
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
