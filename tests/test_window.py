"""The window each layer runs, as tfcompat reads it, against the oracle: transformers' own eager attention.

tfcompat reads a layer's sliding window where upstream keeps it (each attention module's ``sliding_window`` from
4.53; the family table's one-mask rule on 4.51-4.52, and Qwen2-MoE until 5.0) and runs no model to learn it. The
oracle here is the installed release's own text model, built tiny with the settings under test (a window of 2),
run over one 5-token row with eager attention: each attention layer's weights show how many keys its last query
saw. Every family the release serves, every setting the testers and checkpoints use, in every environment.
"""

import itertools

import pytest
import torch

from tfcompat._probe import resolve as _resolve
from tfcompat._probe.families import family, text_config
from tfcompat._probe.tiny import tiny_config
from tfcompat._probe.window import layer_windows

from _helpers import patchable

WINDOW, TOKENS = 2, 5
SETTINGS = [dict(sliding_window=WINDOW, num_hidden_layers=4, max_window_layers=layers, **on, **types)
            for on, layers, types in itertools.product(
                ({"use_sliding_window": True}, {"use_sliding_window": False}, {}), (0, 2),
                ({}, {"layer_types": ["sliding_attention", "full_attention"] * 2}))]


def upstream_windows(fam, text_cfg):
    """``{layer index: window or None}`` as the installed release's eager attention runs them (the oracle)."""
    res = _resolve.resolve("attention.signature", fam.name)
    text_cfg._attn_implementation = "eager"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        text = getattr(res.target, res.plan.text_model)(text_cfg).eval()
    attention = getattr(res.target, fam.attention)
    layers = [m for m in text.modules() if isinstance(m, attention)]
    seen: dict = {}
    handles = [m.register_forward_hook(lambda mod, args, out, i=m.layer_idx: seen.__setitem__(
        i, int((out[1][0, :, -1, :].abs().amax(0) > 0).sum()))) for m in layers]
    ids = torch.arange(3, 3 + TOKENS).view(1, -1)
    with torch.no_grad():
        text(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, output_attentions=True)
    for h in handles:
        h.remove()
    assert len(seen) == len(layers), f"{fam.name}: eager attention returned weights for {len(seen)} of {len(layers)}"
    return {i: None if count >= TOKENS else count for i, count in seen.items()}, layers


@pytest.mark.parametrize("name", patchable())
def test_each_layers_window_is_what_upstreams_eager_attention_applies(name):
    """For each setting this release's config accepts: the window :func:`layer_windows` reads for every attention
    layer equals the keys upstream's own eager attention let that layer's last query see."""
    fam = family(name)
    checked = 0
    for settings in SETTINGS:
        try:
            text_cfg = text_config(tiny_config(name, **settings))
            want, layers = upstream_windows(fam, text_cfg)
        except (ValueError, TypeError, KeyError, IndexError) as exc:  # this release refuses these settings
            print(f"{name} {settings}: upstream refuses it: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        text_cfg._attn_implementation = "sdpa"
        got, how = layer_windows(fam, text_cfg, layers)
        assert {m.layer_idx: got[id(m)] for m in layers} == want, f"{name} {settings}: {how}"
        checked += 1
    assert checked, f"{name}: this release accepted none of the window settings"
