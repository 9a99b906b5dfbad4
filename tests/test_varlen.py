"""varlen_attention and boundaries: the SDPA fallback against upstream's own eager attention per sequence."""

import pytest
import torch

from tfcompat.packing import pack, unpack
from tfcompat.varlen import PackingError, cu_seqlens_from_position_ids, flash_attn_available, varlen_attention


def test_boundaries_from_text_rows():
    ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    cu, longest = cu_seqlens_from_position_ids(ids)
    assert cu.tolist() == [0, 3, 5, 9] and cu.dtype == torch.int32 and longest == 4
    four = torch.stack([ids, ids * 0, ids * 0, ids * 0])  # T/H/W rows may repeat 0 (an image at a start)
    assert cu_seqlens_from_position_ids(four)[0].tolist() == [0, 3, 5, 9]
    # a continuation chunk that does not start at 0 still splits where positions jump
    assert cu_seqlens_from_position_ids(torch.tensor([5, 6, 7, 0, 1]))[0].tolist() == [0, 3, 5]


def test_three_row_ids_are_refused():
    with pytest.raises(PackingError, match="3-row mRoPE ids cannot mark boundaries"):
        cu_seqlens_from_position_ids(torch.zeros(3, 1, 5, dtype=torch.long))


def _upstream_mask(n, window):
    """(n, n) additive mask of upstream's own mask functions for one sequence of ``n`` tokens whose queries see at most
    ``window`` keys: ``masking_utils``' causal / sliding-window causal functions (4.53+), else (4.51-4.52)
    ``AttentionMaskConverter._make_causal_mask``, whose ``sliding_window`` counts one key more."""
    try:
        from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    except ImportError:
        from transformers.modeling_attn_mask_utils import AttentionMaskConverter

        return AttentionMaskConverter._make_causal_mask((1, n), torch.float32, torch.device("cpu"),
                                                        sliding_window=None if window is None else window - 1)[0, 0]
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    i = torch.arange(n)
    allowed = fn(0, 0, i[:, None], i[None, :])
    return torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)


def _reference(q, k, v, cu, window=None):
    """The oracle: upstream's own eager attention (``eager_attention_forward`` of modeling_qwen2, the function
    Qwen2's attention calls under ``eager``: its GQA repeat, scaling and softmax) on each sequence alone, under
    upstream's own causal / sliding-window mask (:func:`_upstream_mask`)."""
    import types

    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

    module = types.SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False)
    out = []
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (t[lo:hi].transpose(0, 1)[None] for t in (q, k, v))  # (1, heads, tokens, dim)
        o, _ = eager_attention_forward(module, qs, ks, vs, _upstream_mask(hi - lo, window)[None, None],
                                       scaling=q.shape[-1] ** -0.5)
        out.append(o[0])  # (tokens, heads, dim)
    return torch.cat(out)


@pytest.mark.parametrize("window", [None, 3])
def test_fallback_matches_per_sequence_attention(window):
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    q = torch.randn(13, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(13, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(13, 2, 8, generator=g, requires_grad=True)
    got = varlen_attention(q, k, v, cu, window=window)
    want = _reference(q, k, v, cu, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    gw = torch.randn(want.shape, generator=g)
    g1 = torch.autograd.grad((got * gw).sum(), (q, k, v))
    g2 = torch.autograd.grad((want * gw).sum(), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bad_boundaries_and_shapes():
    q = torch.zeros(6, 2, 4)
    with pytest.raises(PackingError, match="boundaries run from 0 to 5 but the row has 6 tokens"):
        varlen_attention(q, q, q, torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(PackingError, match="3 query heads are not a multiple of 2 kv heads"):
        varlen_attention(torch.zeros(6, 3, 4), q, q, torch.tensor([0, 6], dtype=torch.int32))
    with pytest.raises(PackingError, match="must be \\(total_tokens, heads, head_dim\\)"):
        varlen_attention(q[None], q, q, torch.tensor([0, 6], dtype=torch.int32))


def test_flash_is_only_chosen_on_cuda():
    assert flash_attn_available(torch.zeros(1)) is False


def test_pack_and_unpack_round_trip_with_left_padding():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 1]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    pk = pack(ids, mask)
    assert pk.input_ids.tolist() == [[5, 6, 7, 8, 9, 1]]
    assert pk.position_ids.tolist() == [[0, 1, 0, 1, 2, 3]] and pk.cu_seqlens.tolist() == [0, 2, 6]
    back = unpack(pk.input_ids.unsqueeze(-1).float(), pk)[..., 0]
    assert torch.equal(back, (ids * mask).float())
    pos3 = torch.arange(4).view(1, 1, 4).expand(3, 2, 4)
    four = pack(ids, mask, pos3).position_ids
    assert four.shape == (4, 1, 6)
    assert four[0, 0].tolist() == [0, 1, 0, 1, 2, 3] and four[1, 0].tolist() == [2, 3, 0, 1, 2, 3]


def _upstream_cu(positions):
    """transformers' own reading of a packed row's boundaries from its position ids, whatever this release names it:
    ``prepare_fa_kwargs_from_position_ids`` (4.56+), ``_prepare_from_posids`` (4.54-4.55) or
    ``prepare_fa2_from_position_ids`` (4.51-4.53): the cu_seqlens it hands flash attention, as a list."""
    import transformers.modeling_flash_attention_utils as fa

    pos = positions.view(1, -1)
    if hasattr(fa, "prepare_fa_kwargs_from_position_ids"):
        out = fa.prepare_fa_kwargs_from_position_ids(pos)
    else:
        fn = getattr(fa, "_prepare_from_posids", None) or fa.prepare_fa2_from_position_ids
        x = torch.zeros(1, pos.shape[1], 1, 1)
        out = fn(x, x, x, pos)
    pairs = [o for o in out if isinstance(o, tuple) and len(o) == 2 and isinstance(o[0], torch.Tensor)]
    return pairs[0][0].tolist()


def test_boundaries_from_positions_are_upstreams_own():
    """The oracle is transformers' own function that reads a packed row's boundaries from position ids for flash
    attention: on every row of up to 5 positions in 0..3 that begins at 0, cu_seqlens_from_position_ids gives
    upstream's cu_seqlens, or refuses a row whose positions go down without restarting at 0 (upstream runs it as
    one sequence whose positions go down, which no collator makes)."""
    import itertools

    agree = refused = 0
    for n in range(1, 6):
        for row in itertools.product(range(4), repeat=n):
            if row[0] != 0:
                continue
            t = torch.tensor(row)
            try:
                cu, longest = cu_seqlens_from_position_ids(t)
            except PackingError:
                refused += 1
                assert any(b < a and b != 0 for a, b in zip(row, row[1:])), row
                continue
            assert cu.tolist() == _upstream_cu(t), (row, cu.tolist(), _upstream_cu(t))
            assert longest == max(b - a for a, b in zip(cu.tolist(), cu.tolist()[1:])), row
            agree += 1
    assert agree > 150 and refused > 50, (agree, refused)
