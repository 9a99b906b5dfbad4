"""Omni thinkers with real audio inputs: patched packed == unpatched padded (logits and every gradient)."""

import pytest
import torch

import tfcompat
from tfcompat._probe.families import FAMILIES as SPECS  # private: probe-only facts the public FamilyInfo leaves out
from tfcompat.embeds import rope_index
from tfcompat.packing import pack, unpack

from _helpers import close_to_model, grads_by_name, param_grads, patchable
from _models import forward_kwargs, padded, run_upstream, tiny_model

OMNI = [n for n in patchable() if "audio_config" in SPECS[n].tiny_top]


def _audio(model, chunks):
    """Mel features of one audio of ``chunks`` windows, its mask, and how many audio tokens the tower makes."""
    owner = model.model if hasattr(getattr(model, "model", None), "audio_tower") else model
    cfg = owner.audio_tower.config
    frames = 2 * cfg.n_window * chunks
    feats = torch.randn(1, cfg.num_mel_bins, frames, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(1, frames, dtype=torch.long)
    with torch.no_grad():
        out = owner.get_audio_features(feats, feature_attention_mask=mask)
    out = getattr(out, "last_hidden_state", out)  # 5.x returns an output object, 4.x a tensor
    return feats, mask, (out[0] if isinstance(out, (tuple, list)) else out).shape[0]


@pytest.mark.parametrize("name", OMNI)
@pytest.mark.parametrize("first", ["audio", "text"])
def test_packed_with_audio_equals_padded(name, first):
    model = tiny_model(name)
    cfg = model.config
    feats, fmask, n_audio = _audio(model, chunks=2)
    audio_row = [10, 11, 12, cfg.audio_start_token_id] + [cfg.audio_token_id] * n_audio + [242, 13, 14]
    rows = [audio_row, list(range(20, 25))] if first == "audio" else [list(range(20, 25)), audio_row]
    ids, mask = padded(rows)
    audio = dict(input_features=feats, feature_attention_mask=fmask)
    g = torch.Generator().manual_seed(7)

    model.zero_grad(set_to_none=True)
    ref = run_upstream(lambda: model(input_ids=ids, attention_mask=mask, use_cache=False,
                                     **forward_kwargs(model, ids, **audio)).logits)
    weights = torch.randn(ref.shape, generator=g)
    (ref * weights * mask[..., None]).sum().backward()
    ref_grads = param_grads(model)

    positions, _ = rope_index(model, ids, attention_mask=mask, audio_seqlens=fmask.sum(-1))
    pk = pack(ids, mask, positions, vision=True)
    tfcompat.patch(model)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False,
                **forward_kwargs(model, pk.input_ids, **audio)).logits
    logits = unpack(out, pk)
    (logits * weights * mask[..., None]).sum().backward()
    valid = mask.bool()
    close_to_model(logits[valid], ref[valid], f"{name} audio logits")
    grads = param_grads(model)
    assert any("audio_tower" in k for k in grads), "the audio tower got no gradient: audio was not used"
    for key, got, want in grads_by_name(grads, ref_grads, f"{name} audio"):
        close_to_model(got, want, f"{name} audio grad {key}")
