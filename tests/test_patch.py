"""Patched model on a packed batch == unpatched model on the padded batch (logits and every gradient)."""

import re

import pytest
import torch

import tfcompat
from tfcompat.errors import TfcompatError, UnsupportedTransformersError
from tfcompat.packing import pack, packed, unpack
from tfcompat.testing import families
from tfcompat.varlen import PackingError

from _helpers import close_to_model, grads_by_name, installed, linear_attention, param_grads, patchable  # noqa: F401
from _models import forward_kwargs, padded, run_upstream, three_d_positions, tiny_model, tiny_pixels, tiny_sequence

SPECS = families(installed_only=False)  # the family facts, from the public face


FAMILIES = [n for n in patchable() if n not in ("llama", "glm")]
VISION = [n for n in FAMILIES if SPECS[n].vision]

CASES = {
    "text": dict(rows=[dict(text=7), dict(text=4)], images=0, videos=0),
    "image": dict(rows=[dict(text=5, image=True), dict(text=3)], images=1, videos=0),
    "starts_with_image": dict(rows=[dict(text=3), dict(text=4, image=True, image_first=True)], images=1, videos=0),
    "video": dict(rows=[dict(text=3, video=True), dict(text=5)], images=0, videos=1),
}


def _run(model, weights, mask, **kwargs):
    model.zero_grad(set_to_none=True)
    logits = model(use_cache=False, **kwargs).logits
    return logits


def _padded_and_packed(name, case):
    spec = CASES[case]
    model = tiny_model(name)
    rows = [tiny_sequence(name, **r) for r in spec["rows"]]
    ids, mask = padded(rows)
    pixels = tiny_pixels(spec["images"], spec["videos"])
    return model, ids, mask, pixels


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("case", list(CASES))
def test_packed_patched_equals_padded_unpatched(name, case):
    if case != "text" and name not in VISION:
        pytest.skip("text family")
    model, ids, mask, pixels = _padded_and_packed(name, case)
    g = torch.Generator().manual_seed(7)

    ref = run_upstream(lambda: _run(model, None, mask, input_ids=ids, attention_mask=mask,
                                    **forward_kwargs(model, ids, **pixels)))
    weights = torch.randn(ref.shape, generator=g)
    (ref * weights * mask[..., None]).sum().backward()
    ref_grads = param_grads(model)

    pk = pack(ids, mask, three_d_positions(model, ids, mask, pixels), vision=SPECS[name].vision)
    record = tfcompat.patch(model)
    layers = model.config.get_text_config().num_hidden_layers
    assert record.attention_modules == layers - record.linear_attention_modules
    out = _run(model, None, mask, input_ids=pk.input_ids, position_ids=pk.position_ids,
               **forward_kwargs(model, pk.input_ids, **pixels))
    logits = unpack(out, pk)
    (logits * weights * mask[..., None]).sum().backward()
    grads = param_grads(model)

    valid = mask.bool()
    close_to_model(logits[valid], ref[valid], f"{name}/{case} logits")
    for key, got, want in grads_by_name(grads, ref_grads, f"{name}/{case}"):
        close_to_model(got, want, f"{name}/{case} grad {key}")


@pytest.mark.parametrize("name", FAMILIES)
def test_unpatched_model_on_a_packed_row_really_differs(name):
    """Guard: without the patch the sequences of a packed row see each other."""
    model, ids, mask, pixels = _padded_and_packed(name, "text")
    ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    pk = pack(ids, mask, vision=SPECS[name].vision)
    if pk.position_ids.dim() != 3:
        pytest.skip("text families: upstream may detect packing from 2-D ids itself")
    # plain running positions: nothing tells upstream where the sequences begin
    with torch.no_grad():
        plain = model(input_ids=pk.input_ids, position_ids=torch.arange(pk.input_ids.shape[1]).view(1, 1, -1)
                      .expand(3, 1, -1), attention_mask=torch.ones_like(pk.input_ids), use_cache=False).logits
    assert not torch.allclose(unpack(plain, pk)[mask.bool()], ref[mask.bool()], atol=1e-4)


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_5", "glm4"])
def test_unpatch_restores_bit_identical_outputs(name):
    if name not in FAMILIES:
        pytest.skip("not in this release")
    model, ids, mask, _ = _padded_and_packed(name, "text")
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        tfcompat.patch(model)
        assert tfcompat.unpatch(model) is True
        after = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(before, after)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert tfcompat.unpatch(model) is False


@pytest.mark.parametrize("name", ["qwen2_vl", "glm4v", "qwen2"])
def test_patch_twice_and_two_models(name):
    if name not in FAMILIES:
        pytest.skip("not in this release")
    a, ids, mask, _ = _padded_and_packed(name, "text")
    b = tiny_model(name)
    pk = pack(ids, mask, vision=SPECS[name].vision)
    first = tfcompat.patch(a)
    assert tfcompat.patch(a) == first
    with torch.no_grad():
        once = a(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False).logits
        tfcompat.patch(a)
        twice = a(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False).logits
        ref_b = b(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(once, twice)
    close_to_model(unpack(once, pk)[mask.bool()], ref_b[mask.bool()], "patched a vs padded b")
    assert not any("_tfcompat_patch" in m.__dict__ or "_tfcompat_model" in m.__dict__ for m in b.modules()), \
        "patching a touched b"


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3"])
def test_incremental_decoding_falls_through(name):
    if name not in FAMILIES:
        pytest.skip("not in this release")
    model, ids, mask, _ = _padded_and_packed(name, "text")
    with torch.no_grad():
        want = model(input_ids=ids[:1], use_cache=True).logits
        tfcompat.patch(model)
        got = model(input_ids=ids[:1], use_cache=True).logits
    assert torch.equal(want, got)


@pytest.mark.parametrize("name", ["qwen2", "qwen2_vl"])
def test_one_sequence_with_explicit_boundaries_runs_upstream(name):
    """A row that holds one sequence, its boundaries passed (a collator's batch of one): validated, then upstream's
    own path, bit-identical to the unpatched model (packing only changes rows that hold several sequences)."""
    if name not in FAMILIES:
        pytest.skip("not in this release")
    vision = bool(SPECS[name].vision)
    ids = torch.tensor([tiny_sequence(name, text=6, image=vision)])
    pixels = tiny_pixels(1 if vision else 0)
    model = tiny_model(name)
    ones = torch.ones_like(ids)
    pk = pack(ids, ones, three_d_positions(model, ids, ones, pixels) if vision else None, vision=vision)
    cu = torch.tensor([0, ids.shape[1]], dtype=torch.int32)
    with torch.no_grad():
        extra = forward_kwargs(model, ids, **pixels)
        # the oracle counts positions itself (4.51-4.57 take no 4-row ids, nor 3-row ids without a mask)
        want = run_upstream(lambda: model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits)
        call = dict(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False, **extra)
        tfcompat.patch(model)
        got = [model(**call, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=ids.shape[1]).logits,
               model(**call, seq_idx=torch.zeros_like(ids, dtype=torch.int32)).logits]
        with packed(cu):
            got.append(model(**call).logits)
        for g in got:
            assert torch.equal(g, want)
        with pytest.raises(PackingError, match="max_length_q is 5"):  # still validated
            model(**call, cu_seq_lens_q=cu, max_length_q=5)


@pytest.mark.parametrize("name", VISION)
def test_a_text_vl_row_as_embeddings_or_with_seq_idx_alone(name):
    """A packed text-only VL row without position ids, given as embeddings (no boundaries: one sequence; with
    ``seq_idx``) or as ids with ``seq_idx`` (DataCollatorWithFlattening(return_seq_idx=True, return_position_ids=
    False)): the padded batch's numbers, on every release (up to 5.0 upstream's own positions read input_ids'
    shape and fail on embeddings alone)."""
    model = tiny_model(name)
    lengths = [5, 9, 1, 4]
    ids, mask = padded([tiny_sequence(name, text=n) for n in lengths])
    pk = pack(ids, mask)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        # the oracle with its mask: 4.5x's GLM-4V fails on ids alone (its own text positions' shape)
        one = model(input_ids=ids[1:2, :9], attention_mask=mask[1:2, :9], use_cache=False).logits
        tfcompat.patch(model)
        embeds = model.get_input_embeddings()(pk.input_ids)
        seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
        for call in (dict(inputs_embeds=embeds, seq_idx=seq_idx), dict(input_ids=pk.input_ids, seq_idx=seq_idx)):
            got = unpack(model(**call, use_cache=False).logits, pk)
            torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=1e-5, atol=1e-5, msg=str(list(call)))
        alone = model(inputs_embeds=model.get_input_embeddings()(ids[1:2, :9]), use_cache=False).logits
        torch.testing.assert_close(alone, one, rtol=1e-5, atol=1e-5)


def test_boundaries_from_the_packed_context_and_kwargs():
    name = "qwen2"
    model, ids, mask, _ = _padded_and_packed(name, "text")
    pk = pack(ids, mask, vision=False)
    tfcompat.patch(model)
    with torch.no_grad():
        want = model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False).logits
        # running positions would hide the boundaries; the context supplies them
        with packed(pk.cu_seqlens):
            got = model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False).logits
    close_to_model(got, want, "context")


@pytest.mark.parametrize("name,mixer", [("qwen2", "attention"), ("qwen2_moe", "attention"), ("qwen3_5", "linear")])
def test_a_mixer_whose_call_lost_the_step_is_refused(name, mixer):
    """The step reaches each mixer only in its own call's arguments: the decoder layers' keyword arguments where the
    text model's reach the attention (the interface route), else the position embeddings, and the linear mixers'
    mask. A pre-hook that rebuilds them (here: keeps only the attention's named parameters, casts cos/sin, or drops
    the mask) is refused in the forward, where a lookup of the step elsewhere would hold only until a recomputation
    in another thread."""
    import inspect

    from tfcompat._step.install import _ATTR

    if name not in FAMILIES:
        pytest.skip(f"{name} is not patchable on this release")
    model, ids, mask, _ = _padded_and_packed(name, "text")
    pk = pack(ids, mask, vision=False)
    tfcompat.patch(model)
    if mixer == "linear" and not linear_attention(name):
        pytest.skip(f"{name} has no linear-attention layers on this release")
    rides = next(getattr(m, _ATTR).rides for m in model.modules() if getattr(m, _ATTR, None) is not None and
                 getattr(m, _ATTR).kind == "text")
    lost = "keyword arguments" if rides else "attention mask" if mixer == "linear" else "position embeddings"

    def rebuild(module, args, kwargs):
        if lost == "keyword arguments":
            named = inspect.signature(type(module).forward).parameters
            kwargs = {k: v for k, v in kwargs.items() if k in named}
        elif lost == "position embeddings":
            kwargs["position_embeddings"] = tuple(t.to(torch.float32) for t in kwargs["position_embeddings"])
        else:
            kwargs["attention_mask"] = None
        return args, kwargs

    ending = "Attention" if mixer == "attention" else "GatedDeltaNet"
    mixers = [m for m in model.modules() if type(m).__name__.endswith(ending)]
    assert mixers
    handles = [m.register_forward_pre_hook(rebuild, with_kwargs=True) for m in mixers]
    call = dict(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False)
    with pytest.raises(TfcompatError, match=f"without the {lost} its decoder layer passed"):
        model(**call)
    for h in handles:
        h.remove()
    model(**call)  # the same call without the hooks runs


def test_three_row_ids_of_a_packed_row_are_refused():
    name = next(n for n in VISION)
    model, ids, mask, _ = _padded_and_packed(name, "text")
    pk = pack(ids, mask, vision=True)
    tfcompat.patch(model)
    with pytest.raises(PackingError, match="3-row mRoPE ids cannot mark where each begins"):
        model(input_ids=pk.input_ids, position_ids=pk.position_ids[1:], use_cache=False)


def test_unsupported_model():
    with pytest.raises(UnsupportedTransformersError, match="cannot tell the model family"):
        tfcompat.patch(torch.nn.Linear(2, 2))


WINDOW_FAMILIES = [n for n in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next", "qwen2_vl") if n in FAMILIES]
# the settings testers and checkpoints use: the window on or off (4.51 windows every layer by sliding_window
# even when off), max_window_layers splitting the stack, explicit layer_types
WINDOW_CASES = {
    "on, max_window_layers 1": dict(use_sliding_window=True, max_window_layers=1),
    "on, max_window_layers 0": dict(use_sliding_window=True, max_window_layers=0),
    "off": dict(use_sliding_window=False, max_window_layers=1),
    "on, layer_types": dict(use_sliding_window=True, max_window_layers=1,
                            layer_types=["full_attention", "sliding_attention", "full_attention"]),
}


@pytest.mark.parametrize("name", WINDOW_FAMILIES)
@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_sliding_window_as_upstream_decides_per_layer(name, case):
    """Sliding-window configs (window 3, 3 layers, sequences of up to 9 tokens): packed == upstream on the padded
    batch, logits and every gradient, whichever layers this release windows for these settings (PatchRecord
    lists the probed window of each layer)."""
    kw = dict(WINDOW_CASES[case], sliding_window=3, num_hidden_layers=3)
    if linear_attention(name):
        if "layer_types" in kw:
            pytest.skip("a hybrid decoder's layer_types name its linear-attention layers")
        kw["num_hidden_layers"] = 4  # the tiny hybrid pattern: linear, full, linear, full
    try:
        ref = tiny_model(name, **kw)
    except (ValueError, TypeError) as exc:
        pytest.skip(f"this release's config refuses these settings: {exc}")
    rows = [tiny_sequence(name, text=9), tiny_sequence(name, text=6)]
    ids, mask = padded(rows)
    weights = torch.randn(*ids.shape, 256, generator=torch.Generator().manual_seed(4))
    want = run_upstream(lambda: ref(input_ids=ids, attention_mask=mask, use_cache=False).logits)
    (want * weights * mask[..., None]).sum().backward()
    model = tiny_model(name, **kw)
    record = tfcompat.patch(model)
    assert len(record.windows) == record.attention_modules and record.windows_how
    assert set(record.windows) <= {None, 3}, record.windows
    pk = pack(ids, mask, vision=SPECS[name].vision)
    got = unpack(model(input_ids=pk.input_ids, position_ids=pk.position_ids).logits, pk)
    (got * weights * mask[..., None]).sum().backward()
    valid = mask.bool()
    close_to_model(got[valid].detach(), want[valid].detach(), f"{name} {case} {record.windows} logits")
    for key, g, w in grads_by_name(param_grads(model), param_grads(ref), f"{name} {case}"):
        close_to_model(g, w, f"{name} {case} {record.windows} grad {key}")


@pytest.mark.parametrize("name", ["qwen2", "qwen2_vl", "qwen3_5"])
def test_bare_text_model(name):
    """patch() also takes the bare decoder stack (what some frameworks hold)."""
    if name not in FAMILIES:
        pytest.skip("not in this release")
    from _models import text_model

    lm = tiny_model(name)
    bare = text_model(lm)
    ids, mask = padded([tiny_sequence(name, text=8), tiny_sequence(name, text=5)])
    with torch.no_grad():
        ref = bare(input_ids=ids, attention_mask=mask, use_cache=False)[0]
        pk = pack(ids, mask, vision=SPECS[name].vision)
        record = tfcompat.patch(bare)
        assert record.attention_modules >= 1
        got = unpack(bare(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False)[0], pk)
        assert tfcompat.unpatch(bare)
    close_to_model(got[mask.bool()], ref[mask.bool()], f"bare {name}")


@pytest.mark.parametrize("name", [n for n in installed() if SPECS[n].patch_refusal])
def test_families_patch_cannot_serve_are_refused_by_name_and_reason(name):
    """Sparse-attention (indexer), MLA and VQ-image decoders: patch refuses before touching the model, naming the
    family and the table's reason; RoPE still works."""
    model = tiny_model(name, num_hidden_layers=1)
    before = {k: v for k, v in vars(model).items() if k == "forward"}
    reason = re.escape(SPECS[name].patch_refusal)
    with pytest.raises(UnsupportedTransformersError, match=f"cannot serve {name}: {reason}"):
        tfcompat.patch(model)
    assert {k: v for k, v in vars(model).items() if k == "forward"} == before
    assert all("forward" not in vars(m) for m in model.modules())
    if SPECS[name].nope:
        with pytest.raises(tfcompat.errors.ConfigError, match="no rotary position embedding"):
            tfcompat.config.rope_parameters(model.config)
    else:
        assert tfcompat.config.rope_parameters(model.config).rotary_dim > 0


def _sections_upstream_runs(name, config):
    """Sections transformers' own model testers use: two contiguous sections (GLM-4.5V's tester: [1, 1]), or
    interleaved ones that add up to more than the rotary frequencies (Qwen3-VL's tester: [16, 8, 8])."""
    from tfcompat.config import rope_parameters

    rp = rope_parameters(config)
    if SPECS[name].mrope == "contiguous":
        half = rp.rotary_dim // 2
        return [half - half // 2, half // 2]
    return [16, 8, 8]


@pytest.mark.parametrize("name", [n for n in VISION if SPECS[n].mrope != "none"])
def test_tester_sections_upstream_runs_are_served(name):
    """rope_parameters reports them, and the patched model on a packed row equals upstream on the padded
    batch (logits and every gradient): tfcompat refuses only what upstream itself cannot run."""
    from tfcompat.config import rope_parameters, text_config
    from tfcompat.testing import model_class, tiny_config

    config = tiny_config(name)
    section = _sections_upstream_runs(name, config)
    tc = text_config(config)
    for key in ("rope_parameters", "rope_scaling"):
        rope = tc.__dict__.get(key)
        if isinstance(rope, dict) and "mrope_section" in rope:
            rope["mrope_section"] = list(section)
    if not any(isinstance(tc.__dict__.get(k), dict) and tc.__dict__[k].get("mrope_section") == section
               for k in ("rope_parameters", "rope_scaling")):
        pytest.skip("this release's tiny config keeps its sections elsewhere")
    assert list(rope_parameters(config).mrope_section) == section
    torch.manual_seed(0)
    model = model_class(name)(config).eval()
    rows = [tiny_sequence(name, text=5, image=True), tiny_sequence(name, text=3)]
    ids, mask = padded(rows)
    pixels = tiny_pixels(1)
    ref = run_upstream(lambda: model(input_ids=ids, attention_mask=mask, use_cache=False,
                                     **forward_kwargs(model, ids, **pixels)).logits)
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3))
    (ref * weights * mask[..., None]).sum().backward()
    ref_grads = param_grads(model)
    pk = pack(ids, mask, three_d_positions(model, ids, mask, pixels), vision=True)
    tfcompat.patch(model)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False,
                **forward_kwargs(model, pk.input_ids, **pixels)).logits
    logits = unpack(out, pk)
    (logits * weights * mask[..., None]).sum().backward()
    close_to_model(logits[mask.bool()], ref[mask.bool()], f"{name} {section} logits")
    for key, got, want in grads_by_name(param_grads(model), ref_grads, f"{name} {section}"):
        close_to_model(got, want, f"{name} {section} grad {key}")
