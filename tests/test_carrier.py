"""The attention call through transformers' own AttentionInterface (``attention.carrier``): where the installed
attention forward looks its function up in ALL_ATTENTION_FUNCTIONS, upstream's forward runs unchanged and tfcompat
serves only the call. The oracle: transformers' own model on the padded batch, and the installed attention class's
own source."""

import inspect
import json
import re
import subprocess
import sys

import pytest
import torch
from packaging.version import Version

import tfcompat
from tfcompat._probe import resolve as _resolve
from tfcompat._probe.families import FAMILIES
from tfcompat.errors import ModelError, TfcompatError
from tfcompat.packing import pack, unpack
from tfcompat.testing import tiny_model
from tfcompat.version import transformers_version

from _helpers import modeling, patchable

SERVED = patchable()
V5 = transformers_version().major >= 5


def _routes(name):
    """Independently of the probe: does the installed attention class's forward (imported, its own source) hand the
    call to ALL_ATTENTION_FUNCTIONS with its kwargs?"""
    src = inspect.getsource(getattr(modeling(name), FAMILIES[FAMILIES[name].text_family or name].attention).forward)
    return "ALL_ATTENTION_FUNCTIONS" in src and bool(re.search(r"attention_interface\([^)]*\*\*kwargs", src, re.S))


@pytest.mark.parametrize("name", SERVED)
def test_the_carrier_is_what_the_installed_attention_does(name):
    got = _resolve.resolve("attention.carrier", name)
    assert got.impl == ("interface" if _routes(name) else "forward"), got
    model = tiny_model(name)
    record = tfcompat.patch(model)
    cls = getattr(modeling(name), FAMILIES[FAMILIES[name].text_family or name].attention)
    attentions = [m for m in model.modules() if isinstance(m, cls)]
    carriers = {m.__dict__["_tfcompat_patch"].carrier for m in attentions}
    assert carriers == {got.impl}, (name, carriers)
    keys = {m.config._attn_implementation for m in attentions}
    if got.impl == "interface":  # each patched attention's own config copy names this copy's key; the model's does not
        assert keys == {"tfcompat:packed"} and model.config._attn_implementation != "tfcompat:packed"
    tfcompat.unpatch(model)
    assert {m.config._attn_implementation for m in attentions} != {"tfcompat:packed"}
    assert record.family == name


def _kwargs_reach(model, text_cls_name):
    """Independently of the probe: do the installed text model's kwargs reach its mixers (its forward hands
    ``**kwargs`` to each decoder layer it holds, whose forward hands ``**kwargs`` to ``self.self_attn`` and to
    ``self.linear_attn`` where it calls one)? Read from
    the imported classes of the model's own modules."""
    text = next(m for m in model.modules() if type(m).__name__ == text_cls_name)
    layer = text.layers[0]
    text_src = inspect.getsource(type(text).forward)
    layer_src = inspect.getsource(type(layer).forward)
    linear = "self.linear_attn(" not in layer_src or \
        bool(re.search(r"self\.linear_attn\([^)]*\*\*kwargs", layer_src, re.S))
    return bool(re.search(r"decoder_layer(\.__call__)?[,(][^)]*?\*\*(kwargs|flash_attn_kwargs)", text_src, re.S)) and \
        bool(re.search(r"self\.self_attn\([^)]*\*\*kwargs", layer_src, re.S)) and linear


@pytest.mark.parametrize("name", SERVED)
def test_the_step_rides_the_layers_kwargs_where_they_reach_the_attention(name):
    """Where upstream's text model hands its kwargs down to the attention (and no linear mixer shares the layers),
    the step rides there, as transformers' own ``cu_seq_lens_q`` does: the rotary module and the decoder layers keep
    upstream's forwards (not patched). Under transformers' gradient checkpointing (which replays the layers' kwargs)
    the patched packed row equals transformers' own model on the padded batch, logits and gradients."""
    from tfcompat._step.install import _ATTR

    carrier = _resolve.resolve("attention.carrier", name)
    plan = _resolve.resolve("attention.signature", name).plan
    model = tiny_model(name).train()
    kinds = lambda: {getattr(m, _ATTR).kind for m in model.modules() if getattr(m, _ATTR, None) is not None}  # noqa
    reach = carrier.impl == "interface" and _kwargs_reach(model, plan.text_model)
    assert (carrier.plan is not None and carrier.plan.kwargs_reach) == reach, (name, carrier)
    ids, mask, pk = _batch(model.config.get_text_config().vocab_size)
    want = model(input_ids=ids, attention_mask=mask).logits
    want_grads = torch.autograd.grad(want[mask.bool()].square().sum(), list(model.parameters()), allow_unused=True)
    tfcompat.patch(model)
    rides = reach
    assert ("layer" not in kinds() and "rotary" not in kinds()) == rides, (name, kinds())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    got = unpack(model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False).logits, pk)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=2e-5)
    got_grads = torch.autograd.grad(got[mask.bool()].square().sum(), list(model.parameters()), allow_unused=True)
    for p, g, w in zip(model.parameters(), got_grads, want_grads):
        zero = torch.zeros_like(p)  # the vision weights of a text-only VL step: zero (dummy_visual), upstream None
        torch.testing.assert_close(zero if g is None else g, zero if w is None else w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", [n for n in ("qwen2", "qwen2_vl") if n in SERVED])
def test_a_patched_model_called_inside_another_ones_step_runs_its_own_call(name):
    """A patched model called from inside another patched model's packed step (a hook on a decoder layer: a reward
    or reference model, a probe) runs its own call, not the outer step: the step this thread runs belongs to the
    model that decided it. The inner row has as many tokens as the outer packed row, so the outer boundaries would
    fit it. Oracle: transformers' own models, the outer on the padded batch, the inner on its row."""
    outer, inner = tiny_model(name), tiny_model(name)
    ids, mask, pk = _batch(outer.config.get_text_config().vocab_size)
    inner_ids = torch.arange(3, 3 + pk.input_ids.shape[1]).unsqueeze(0)  # one sequence of the packed row's length
    with torch.no_grad():
        want_outer, want_inner = outer(input_ids=ids, attention_mask=mask).logits, inner(input_ids=inner_ids).logits
    tfcompat.patch(outer)
    tfcompat.patch(inner)
    seen = []
    layer = next(m for m in outer.modules() if type(m).__name__.endswith("DecoderLayer"))
    handle = layer.register_forward_hook(lambda *_: seen.append(inner(input_ids=inner_ids).logits))
    try:
        with torch.no_grad():
            got = unpack(outer(input_ids=pk.input_ids, position_ids=pk.position_ids).logits, pk)
    finally:
        handle.remove()
    torch.testing.assert_close(seen[0], want_inner, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got[mask.bool()], want_outer[mask.bool()], atol=2e-5, rtol=2e-5)


class _Squares(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every tensor an op returns shaped as upstream's masks are, (batch, 1, tokens, tokens): torch's own
    dispatch hook. (A linear mixer's chunked kernel makes (1, heads, chunks, n, n) blocks of its own.)"""

    def __init__(self, tokens):
        super().__init__()
        self.tokens, self.seen = tokens, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.dim() == 4 and tuple(o.shape[1:]) == (1, self.tokens, self.tokens):
                self.seen.append((str(func), tuple(o.shape)))
        return out


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("name", SERVED)
def test_a_packed_row_builds_no_tokens_by_tokens_mask(name, impl):
    """Where upstream's text model takes its masks ready-made by layer type (``isinstance(causal_mask_mapping :=
    attention_mask, dict)`` in its own forward, read here from the imported class) and the step rides the layers'
    kwargs, a packed step hands None for each: no op returns a (tokens, tokens) mask, under SDPA and eager, and the
    row still equals transformers' own model on the padded batch. Elsewhere the text model builds its own masks
    (SDPA skips a causal one; eager builds it): the probe's reading is checked, nothing is run."""
    res = _resolve.resolve("attention.signature", name)
    source = inspect.getsource(getattr(res.target, res.plan.text_model).forward)
    takes = "isinstance(causal_mask_mapping := attention_mask, dict)" in source
    carrier = _resolve.resolve("attention.carrier", name).plan
    riding = carrier is not None and carrier.kwargs_reach
    assert bool(riding and carrier.masks_by_type) == (riding and takes), (name, carrier)
    if not (riding and takes):
        pytest.skip(f"{name}: the text model builds its own masks on transformers {transformers_version()}")
    model = tiny_model(name, attn_implementation=impl)
    ids, mask, pk = _batch(model.config.get_text_config().vocab_size)
    want = model(input_ids=ids, attention_mask=mask).logits
    tfcompat.patch(model)
    squares = _Squares(pk.input_ids.shape[-1])
    with squares:
        got = unpack(model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False).logits, pk)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=2e-5)
    assert not squares.seen, (name, impl, squares.seen[:3])


def test_the_boundary_families_route_through_the_interface_on_5x():
    if not V5:
        # 4.51-4.52: Qwen2-VL / Qwen2.5-VL keep per-implementation attention classes (the bundled forward serves them)
        if "qwen2_vl" in SERVED and transformers_version() < Version("4.53"):
            assert _resolve.resolve("attention.carrier", "qwen2_vl").impl == "forward"
        pytest.skip("the 5.x families' carrier: checked on 5.x")
    for name in ("qwen2", "qwen3", "qwen2_5_vl", "glm4v", "qwen3_vl"):
        if name in SERVED:
            assert _resolve.resolve("attention.carrier", name).impl == "interface", name


def test_report_json_carries_the_carrier():
    out = subprocess.run([sys.executable, "-m", "tfcompat", "report", "--json"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    rows = {r["capability"]: r for r in json.loads(out.stdout)["resolutions"]}
    for name in SERVED:
        row = rows[f"attention.carrier:{name}"]
        assert row["impl"] in ("interface", "forward") and row["reason"], row


def _batch(vocab=60):
    ids = torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 0, 0]]) % vocab
    mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    return ids, mask, pack(ids, mask)


def _moved(cls, how):
    """A subclass of upstream's attention whose forward adds what a new release might: an output gate computed from
    the hidden states, around upstream's own body (``gate``); or its own attention over the whole row (``own``)."""

    class Moved(cls):
        def forward(self, hidden_states, *args, **kwargs):
            if how == "own":  # computes attention itself: never calls ALL_ATTENTION_FUNCTIONS
                b, s, _ = hidden_states.shape
                q = self.q_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
                k = self.k_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
                v = self.v_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
                rep = q.shape[1] // k.shape[1]
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
                return (self.o_proj(out.transpose(1, 2).reshape(b, s, -1)), None)
            out = super().forward(hidden_states, *args, **kwargs)
            return (out[0] * torch.sigmoid(self.extra_gate(hidden_states)),) + tuple(out[1:])

    Moved.__name__ = f"Moved{cls.__name__}"
    return Moved


def _move(model, name, how):
    cls = getattr(modeling(name), FAMILIES[FAMILIES[name].text_family or name].attention)
    torch.manual_seed(1)
    attentions = [m for m in model.modules() if isinstance(m, cls)]  # 4.x: per-implementation subclasses too
    moved = {t: _moved(t, how) for t in {type(m) for m in attentions}}
    for m in attentions:
        m.__class__ = moved[type(m)]
        hidden = m.o_proj.out_features
        m.extra_gate = torch.nn.Linear(hidden, hidden)


TEXT = [n for n in ("qwen2", "qwen3", "glm4", "qwen3_moe", "qwen3_next", "glm_moe_dsa", "qwen2_vl", "glm4v")
        if n in SERVED]


@pytest.mark.parametrize("name", TEXT)
def test_a_moving_attention_body(name):
    """Upstream adds an operation to the attention forward (here a subclass adds an output gate): where the interface
    carries the step the patched model equals the unpatched one on the padded batch, logits and gradients, because
    upstream's body runs; where tfcompat's bundled forward would serve it, patch() refuses (it would drop the gate)."""
    model = tiny_model(name).train()
    _move(model, name, "gate")
    ids, mask, pk = _batch(model.config.get_text_config().vocab_size)
    want = model(input_ids=ids, attention_mask=mask).logits
    want_grads = torch.autograd.grad(want[mask.bool()].square().sum(), [p for p in model.parameters()],
                                     allow_unused=True)
    if _resolve.resolve("attention.carrier", name).impl == "forward":
        with pytest.raises(ModelError, match="overrides"):
            tfcompat.patch(model)
        return
    tfcompat.patch(model)
    got = unpack(model(input_ids=pk.input_ids, position_ids=pk.position_ids).logits, pk)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=2e-5)
    got_grads = torch.autograd.grad(got[mask.bool()].square().sum(), [p for p in model.parameters()],
                                    allow_unused=True)
    for p, g, w in zip(model.parameters(), got_grads, want_grads):
        # a text-only VL step reaches the vision weights with zero gradients (dummy_visual); upstream leaves them None
        zero = torch.zeros_like(p)
        torch.testing.assert_close(zero if g is None else g, zero if w is None else w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", [n for n in ("qwen2", "qwen3") if n in SERVED])
def test_an_attention_override_that_skips_the_interface_is_refused(name):
    """An override that runs its own kernel over the whole row would let the sequences of a packed row attend to each
    other: the eager step sees that tfcompat's function was never called and refuses, naming what to do."""
    model = tiny_model(name)
    _move(model, name, "own")
    ids, mask, pk = _batch(model.config.get_text_config().vocab_size)
    if _resolve.resolve("attention.carrier", name).impl == "forward":
        with pytest.raises(ModelError, match="overrides"):
            tfcompat.patch(model)
        return
    tfcompat.patch(model)
    with pytest.raises(TfcompatError, match="without calling the attention function"):
        model(input_ids=pk.input_ids, position_ids=pk.position_ids)
    model(input_ids=ids, attention_mask=mask)  # not packed: the override runs as written


def test_another_implementation_after_patch_is_refused():
    """A model patched while it ran sdpa, switched to an implementation tfcompat does not hand calls to (flash
    attention reads the module's config key), is refused with what to do, never run with a stale choice."""
    model = tiny_model("qwen2")
    tfcompat.patch(model)
    if _resolve.resolve("attention.carrier", "qwen2").impl == "forward":
        pytest.skip("qwen2's attention is served by the bundled forward on this release")
    model.config._attn_implementation_internal = "flash_attention_2"
    ids, _, _ = _batch(model.config.vocab_size)
    with pytest.raises(TfcompatError, match="patch\\(model\\) again"):
        model(input_ids=ids[:1])


@pytest.mark.parametrize("name", [n for n in ("qwen3", "qwen2_5_vl") if n in SERVED])
def test_a_chosen_rotation_keeps_the_bundled_forward(name, monkeypatch):
    """TFCOMPAT_ROPE_IMPL naming one of tfcompat's rotations when ``patch`` runs (here ``native``, the CPU kernel; on a
    GPU ``triton``) keeps the bundled attention forward, which rotates with that kernel: upstream's forward on the
    interface route would rotate with upstream's function and the choice would be silently dropped. Unset, the
    interface serves. Either way the packed step equals transformers' own model on the padded batch."""
    ids, mask, pk = _batch()
    carriers = {}
    for chosen in ("native", None):
        if chosen:
            monkeypatch.setenv("TFCOMPAT_ROPE_IMPL", chosen)
        else:
            monkeypatch.delenv("TFCOMPAT_ROPE_IMPL", raising=False)
        model = tiny_model(name)
        want = model(input_ids=ids, attention_mask=mask).logits
        tfcompat.patch(model)
        carriers[chosen] = {m.__dict__["_tfcompat_patch"].carrier for m in model.modules()
                            if "_tfcompat_patch" in m.__dict__ and m.__dict__["_tfcompat_patch"].kind == "attention"}
        got = unpack(model(input_ids=pk.input_ids, position_ids=pk.position_ids).logits, pk)
        torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=2e-5)
    assert carriers["native"] == {"forward"}, carriers
    assert carriers[None] == {_resolve.resolve("attention.carrier", name).impl}, carriers
    monkeypatch.setenv("TFCOMPAT_ROPE_IMPL", "native")  # an override where the chosen rotation keeps the forward
    model = tiny_model(name)
    _move(model, name, "gate")
    with pytest.raises(ModelError, match="TFCOMPAT_ROPE_IMPL=native|overrides"):
        tfcompat.patch(model)


@pytest.mark.parametrize("name", [n for n in ("qwen2", "qwen2_5_vl", "qwen3_5", "qwen2_moe") if n in SERVED])
def test_fsdp2_mixed_precision_input_cast(name):
    """FSDP2's ``MixedPrecisionPolicy`` (``cast_forward_inputs``, its default) rebuilds every sharded layer's arguments
    with torch's own ``_apply_to_tensors`` (a tuple as ``type(x)(...)``, a dataclass by ``dataclasses.replace``),
    here as a pre-hook on each decoder layer, casting to the weights' own dtype. Where the step rides the layers'
    kwargs the packed row equals transformers' own model on the padded batch; on the rotary-output route the rebuilt
    tuple has lost the step: a TfcompatError that names the cast (was a raw AttributeError)."""
    import functools

    from torch.distributed.utils import _apply_to_tensors

    from tfcompat._step.install import _ATTR

    model = tiny_model(name)
    ids, mask, pk = _batch(model.config.get_text_config().vocab_size)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    tfcompat.patch(model)
    cast = functools.partial(lambda dtype, t: t.to(dtype) if torch.is_floating_point(t) else t, torch.float32)
    text = next(m for m in model.modules() if getattr(m, _ATTR, None) is not None and getattr(m, _ATTR).kind == "text")
    for layer in text.layers:
        layer.register_forward_pre_hook(lambda m, a, k: (_apply_to_tensors(cast, a), _apply_to_tensors(cast, k)),
                                        with_kwargs=True)
    call = dict(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False)
    if not getattr(text, _ATTR).rides:
        with pytest.raises(TfcompatError, match="MixedPrecisionPolicy"):
            model(**call)
        return
    with torch.no_grad():
        got = unpack(model(**call).logits, pk)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=2e-5)
