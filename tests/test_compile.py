"""torch.compile over a patched model as users compile it: per decoder layer (the FSDP2 recipe's
``layer.compile()``), across training steps whose packed boundaries differ as every step's do. Counted with
torch's own counting backend over AOT autograd, against the unpatched model compiled the same way on padded
batches of the same rows; compiled equals eager, forward and backward.
"""

import logging

import pytest
import torch

import tfcompat
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
