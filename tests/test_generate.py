"""generate() on patched models along upstream's own generation paths, as transformers' GenerationTesterMixin
drives them: left and right padding, static and sliding-window caches, a compiled decoding step, continuation
from returned ``past_key_values``, assisted and prompt-lookup decoding, beam search; text and VL families (an
image in the prompt). RL rollouts and agent loops run these with the policy that trains packed.

Oracle: the unpatched model's own generate() on the same call (tokens and, where returned, logits). Where the
installed release's unpatched model cannot run a path, the case is skipped saying so.
"""

import os

import pytest
import torch

import tfcompat
from tfcompat.testing import families

from _helpers import patchable
from _models import forward_kwargs, tiny_model, tiny_pixels, tiny_sequence

SPECS = families(installed_only=False)  # the family facts, from the public face


# torch.compile costs seconds per family: the compiled path runs on the boundary releases of the matrix
BOUNDARY = os.environ.get("TFCOMPAT_BOUNDARY_TESTS") != "skip"

HAVE = patchable()
# Qwen2 (sliding-window settings), Qwen3 (layer_types: one mask per layer type under a static cache), the mRoPE
# layouts: contiguous (Qwen2-VL, GLM-4V) and interleaved with deepstack (Qwen3-VL)
NAMES = [n for n in ("qwen2", "qwen3", "qwen2_vl", "glm4v", "qwen3_vl") if n in HAVE]
# sample / assisted_sample: upstream's own generation tests (test_sample_generate, test_assisted_decoding_sample), the
# same seed for both models
PATHS = ("left_padding", "right_padding", "static", "sliding_window", "compiled", "continue", "assisted",
         "prompt_lookup", "beam", "sample", "assisted_sample")
UPSTREAM_LIMITS = (ValueError, RuntimeError, TypeError, AttributeError, NotImplementedError, IndexError, KeyError)


def _left_padded(rows):
    length = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), length), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, length - len(r):] = torch.as_tensor(r)
        mask[i, length - len(r):] = 1
    return ids, mask


def _call(name, path):
    """The prompt batch and generate() keyword arguments of one path."""
    vision = SPECS[name].vision
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    if path == "right_padding":  # one prompt with padding after its real tokens (assisted decoding runs these)
        rows = [tiny_sequence(name, text=5, image=vision)]
        ids = torch.tensor([rows[0] + [0, 0, 0]])
        mask = torch.tensor([[1] * len(rows[0]) + [0, 0, 0]])
        images = int(vision)
    elif path in ("assisted", "assisted_sample", "prompt_lookup", "continue"):
        ids, mask = _left_padded([tiny_sequence(name, text=6, image=vision)])
        images = int(vision)
    else:
        ids, mask = _left_padded([tiny_sequence(name, text=5, image=vision), tiny_sequence(name, text=9)])
        images = int(vision)
    if path == "static":
        kw["cache_implementation"] = "static"
    elif path == "sliding_window":
        kw["cache_implementation"] = "sliding_window"
    elif path == "compiled":
        from transformers.generation.configuration_utils import CompileConfig

        compile_config = CompileConfig(backend="aot_eager", fullgraph=False)
        compile_config._compile_all_devices = True  # what upstream's own compile tests set to compile on CPU
        kw.update(cache_implementation="static", compile_config=compile_config)
    elif path == "prompt_lookup":
        kw["prompt_lookup_num_tokens"] = 2
    elif path == "beam":
        kw.update(num_beams=2, num_return_sequences=2)
    elif path in ("sample", "assisted_sample"):
        kw.update(do_sample=True, top_k=0, num_return_sequences=1 if path == "assisted_sample" else 2)
    else:
        kw.update(output_logits=True, return_dict_in_generate=True)
    return ids, mask, tiny_pixels(images), kw


def _overrides(name, path):
    if path == "sliding_window" and not SPECS[name].vision:
        return dict(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    return {}


def _generate(model, name, path, ids, mask, pixels, kw, assistant=None, types=True):
    extra = forward_kwargs(model, ids, **pixels)
    if not types:  # as 4.x callers and processors call it
        extra.pop("mm_token_type_ids", None)
    if path.startswith("assisted"):
        kw = dict(kw, assistant_model=assistant)
    torch.manual_seed(0)  # sampling: the same draws for the patched and the unpatched model
    out = model.generate(input_ids=ids, attention_mask=mask, **extra, **kw)
    if path != "continue":
        return out
    # a second turn on the returned cache: the first turn's tokens, two new ones, and generate() again
    seq = torch.cat((out.sequences, torch.tensor([[11, 12]])), dim=1)
    more = model.generate(input_ids=seq, attention_mask=torch.ones_like(seq), past_key_values=out.past_key_values,
                          **dict(kw, return_dict_in_generate=True, output_logits=True))
    return more


# the VL tiny configs carry no sliding window (the text families cover the sliding cache); one compiled text and
# one compiled VL family where the release has them (compiling costs seconds per family on CPU)
COMPILED = ([n for n in ("qwen3", "qwen3_vl") if n in NAMES] or NAMES[:1]) if BOUNDARY else []
CASES = [(n, p) for n in NAMES for p in PATHS
         if not (p == "sliding_window" and SPECS[n].vision) and (p != "compiled" or n in COMPILED)]
if not BOUNDARY:  # between the boundary releases: the paths that once failed, on one text and one VL family
    CASES = [(n, p) for n, p in CASES if p in ("static", "continue", "right_padding") and
             n in ([m for m in NAMES if not SPECS[m].vision][:1] + [m for m in NAMES if SPECS[m].vision][:1])]


def _both(name, path, ids, mask, pixels, kw, overrides=None, types=True):
    """(patched, unpatched) generate() of one call: the unpatched model with what the 5.x processor returns, the
    patched one with ``mm_token_type_ids`` only if ``types``; skipped where upstream's own generate() cannot run
    the path. The patched model is returned too (its hooks are checked by some tests)."""
    overrides = overrides or {}
    plain = tiny_model(name, **overrides)
    helper = tiny_model(name, seed=1, **overrides) if path.startswith("assisted") else None
    try:
        want = _generate(plain, name, path, ids, mask, pixels, kw, helper)
    except UPSTREAM_LIMITS as exc:
        pytest.skip(f"the unpatched model's own generate() cannot run {path} here: {type(exc).__name__}: "
                    f"{str(exc)[:200]}")
    torch._dynamo.reset()
    model = tiny_model(name, **overrides)
    tfcompat.patch(model)
    if helper is not None:
        helper = tiny_model(name, seed=1, **overrides)
        tfcompat.patch(helper)
    got = _generate(model, name, path, ids, mask, pixels, kw, helper, types=types)
    sequences = [getattr(x, "sequences", x) for x in (got, want)]
    assert torch.equal(*sequences), (path, sequences)
    return got, want, model


@pytest.mark.parametrize("name,path", CASES)
def test_generate_path_equals_the_unpatched_model(name, path):
    ids, mask, pixels, kw = _call(name, path)
    got, want, _ = _both(name, path, ids, mask, pixels, kw, _overrides(name, path))
    for step, (g, w) in enumerate(zip(getattr(got, "logits", None) or (), getattr(want, "logits", None) or ())):
        assert torch.equal(g, w), f"{path}: logits of step {step}"


VL_CASES = [(n, p) for n in NAMES for p in PATHS if SPECS[n].vision and p != "sliding_window" and
            (p != "compiled" or n in COMPILED)]


@pytest.mark.parametrize("name,path", VL_CASES)
def test_generate_without_mm_token_type_ids_equals_the_unpatched_model_with_them(name, path):
    """An RL rollout written for 4.x: generate() with an image and no ``mm_token_type_ids``. 5.16+ places the
    vision tokens in generate() before any forward (``rope_deltas`` 0 without them: every decoding step on text
    positions); the patched model supplies them there too, so it decodes as the unpatched model given what the
    5.x processor returns (with them). Where the release's forward takes no ``mm_token_type_ids`` both calls are
    the same call."""
    ids, mask, pixels, kw = _call(name, path)
    _, _, model = _both(name, path, ids, mask, pixels, kw, types=False)
    tfcompat.unpatch(model)
    assert "_prepare_position_ids_for_generation" not in model.__dict__


MASKED_CASES = [(n, p) for n in NAMES for p in ("assisted", "assisted_sample", "left_padding")]


@pytest.mark.parametrize("name,path", MASKED_CASES)
def test_generate_with_the_prompts_last_token_masked_equals_the_unpatched_model(name, path):
    """transformers' own test_assisted_decoding_matches_greedy_search masks the prompt's last token: 5.x's VL
    models then hand the text model position ids ``[0 .. n-2, 0, 1]`` under a mask ``[1 .. 1, 0, 1]``. A row with
    padding is upstream's own path, never a packed row: the patched model runs it as upstream does (it used to
    refuse it: "position ids go down ... without restarting at 0")."""
    ids, mask, pixels, kw = _call(name, path)
    mask = mask.clone()
    mask[:, -1] = 0
    _both(name, path, ids, mask, pixels, kw)


@pytest.mark.parametrize("name", [n for n in NAMES if not SPECS[n].vision])
def test_a_masked_token_between_positions_is_upstreams_path(name):
    """The forward generate() makes there, on a text family: positions ``[0 .. n-2, 0, 1]``, mask ``[1 .. 1, 0,
    1]``: the patched model's logits equal the unpatched model's; real tokens that restart at 0 under padding (a
    packed row with padding) are still refused."""
    from tfcompat.errors import PackingError

    n = 7
    ids = torch.tensor([tiny_sequence(name, text=n + 2)[: n + 2]])
    pos = torch.tensor([list(range(n)) + [0, 1]])
    mask = torch.tensor([[1] * n + [0, 1]])
    plain = tiny_model(name)
    with torch.no_grad():
        want = plain(input_ids=ids, position_ids=pos, attention_mask=mask).logits
    model = tiny_model(name)
    tfcompat.patch(model)
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=pos, attention_mask=mask).logits
    torch.testing.assert_close(got, want)
    packed_with_padding = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 0]])
    with pytest.raises(PackingError, match="attention_mask has padding"):
        model(input_ids=ids, position_ids=packed_with_padding, attention_mask=torch.tensor([[1] * 8 + [0]]))
