"""Property-based fuzz of sequence-parallel shards over 4 spawned gloo ranks: hypothesis draws the layout
(Ulysses over 4, context parallel over 4, the 2x2 mesh of both), the call (each rank's slice, or the whole row
under ``slice_inputs=True``), ids or embeddings, where the boundaries come from (the slice's position ids, the
whole row's ``cu_seq_lens_q/k`` as DataCollatorWithFlattening gives them, both, ``seq_idx``,
``tfcompat.packing.packed(cu)``, none for one sequence) and labels. Two outcomes are allowed, the same on every
rank: the gathered logits equal the unpatched padded batch's, or a TfcompatError. Hypothesis draws the examples
once in the parent; every rank runs that list in order, a barrier after each; a rank that diverges ends by the
process group's timeout, not a hang.
"""

import collections
import functools
import inspect
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

import tfcompat
from tfcompat.errors import TfcompatError
from tfcompat.packing import pack, packed, unpack
from tfcompat.ulysses import gather_from_ranks, slice_for_rank

from _dist import merged, run_cases, sequence_groups, spawn
from _helpers import SPAWNED_RANKS_SKIPPED, patchable
from _models import padded, tiny_model, tiny_sequence

pytestmark = pytest.mark.xdist_group("fuzz_sp")
if SPAWNED_RANKS_SKIPPED:
    pytest.skip("the sequence-parallel fuzz runs on the boundary releases of the matrix (tox.ini says which)",
                allow_module_level=True)
hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

WORLD = 4
NAMES = [n for n in ("qwen2", "qwen2_vl") if n in patchable()]
PRELOAD_FAMILIES = NAMES
EXAMPLES = int(os.environ.get("TFCOMPAT_SP_FUZZ_EXAMPLES", "60"))


def _example(name, how, whole, embeds, source, labels, lengths, counts):
    if os.environ.get("TFCOMPAT_TEST_VERBOSE"):
        print(f"[rank {dist.get_rank()} {time.strftime('%X')}] {name} {how} whole={whole} embeds={embeds} "
              f"{source} labels={labels} {lengths}", file=sys.stderr, flush=True)
    if source == "none":
        lengths = lengths[:1]  # a row with no boundaries is one sequence
    rows = [tiny_sequence(name, text=n) for n in lengths]
    ids, mask = padded(rows)
    pk = pack(ids, mask)
    plain = tiny_model(name, num_key_value_heads=2)
    with torch.no_grad():
        want = plain(input_ids=ids, attention_mask=mask).logits
    model = tiny_model(name, num_key_value_heads=2)
    patch_kw, split = sequence_groups(how)
    tfcompat.patch(model, slice_inputs=whole, **patch_kw)
    n = pk.input_ids.shape[1]
    cut = (lambda x, dim=1: x) if whole else (lambda x, dim=1: slice_for_rank(x, dim=dim, **split))
    kw = {}
    row = model.get_input_embeddings()(pk.input_ids) if embeds else pk.input_ids
    kw["inputs_embeds" if embeds else "input_ids"] = cut(row)
    if source in ("positions", "cu+positions"):
        kw["position_ids"] = cut(pk.position_ids)
    if source in ("cu", "cu+positions"):
        kw.update(cu_seq_lens_q=pk.cu_seqlens, cu_seq_lens_k=pk.cu_seqlens, max_length_q=pk.max_seqlen,
                  max_length_k=pk.max_seqlen)
    if source == "seq_idx":
        seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).view(1, -1)
        kw["seq_idx"] = cut(seq)
    if labels == "shift_labels" and not any(p.kind == p.VAR_KEYWORD for p in
                                            inspect.signature(type(model).forward).parameters.values()):
        labels = "labels"  # a forward that takes no shift_labels (4.51's Qwen2-VL): labels alone
    if labels != "none":
        kw["labels"] = cut(pk.input_ids)
    if labels == "shift_labels":  # the row's targets (the next token of the same sequence), sliced as the inputs
        shift = torch.nn.functional.pad(pk.input_ids[:, 1:], (0, 1), value=-100)
        shift[0, pk.cu_seqlens[1:].long() - 1] = -100
        kw["shift_labels"] = shift if whole else slice_for_rank(shift, dim=1, pad_value=-100, **split)
        kw["num_items_in_batch"] = int((shift != -100).sum())
    try:
        with torch.no_grad():
            if source == "packed(cu)":
                with packed(pk.cu_seqlens, pk.max_seqlen):
                    out = model(**kw)
            else:
                out = model(**kw)
            local = out.logits
    except TfcompatError as exc:
        if os.environ.get("TFCOMPAT_TEST_VERBOSE") and dist.get_rank() == 0:
            print(f"    -> {str(exc)[:160]}", file=sys.stderr, flush=True)
        counts[f"{how}/{source}: clear error ({type(exc).__name__})"] += 1
        return
    got = unpack(gather_from_ranks(local, dim=1, length=n, **split), pk)
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-4, atol=1e-4,
                               msg=lambda m: f"{name} {how} whole={whole} {source} labels={labels}: {m}")
    if labels != "none":
        # the only labels a share may pass come with the row's shifted targets and count: the ranks' losses (sums
        # over their targets, divided by the row's count) add up to the padded batch's mean loss
        assert labels == "shift_labels", f"{name} {how} whole={whole} {source}: labels of a share were not refused"
        with torch.no_grad():
            want_loss = plain(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        total = out.loss.detach().clone()
        dist.all_reduce(total)  # every layout here shares one row over all the ranks
        torch.testing.assert_close(total, want_loss, rtol=1e-4, atol=1e-4, equal_nan=True,  # a row with no targets: 0/0
                                   msg=lambda m: f"{name} {how} {source}: the ranks' losses: {m}")
        counts[f"{how}/{source}: loss equals oracle"] += 1
    counts[f"{how}/{source}: equals oracle"] += 1


def _draw(n):
    """The examples, drawn by hypothesis once in the parent (derandomized) and handed to every rank: the ranks run
    one list in one order. Hypothesis run inside each rank drew differently on different ranks (its generation
    reads the clock), so the ranks met different collectives and hung."""
    from hypothesis import HealthCheck, Phase, given, settings

    drawn = []

    @settings(max_examples=n, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(name=st.sampled_from(NAMES), how=st.sampled_from(["ulysses", "context", "2x2"]), whole=st.booleans(),
           embeds=st.booleans(), labels=st.sampled_from(["none", "labels", "shift_labels"]),
           source=st.sampled_from(["positions", "cu", "cu+positions", "seq_idx", "packed(cu)", "none"]),
           lengths=st.lists(st.integers(1, 9), min_size=1, max_size=4))
    def collect(**example):
        drawn.append(example)

    collect()
    return drawn


def _cases(rank, world, examples):
    counts = collections.Counter()
    cases = [(f"example {i}: {e}", functools.partial(_example, counts=counts, **e)) for i, e in enumerate(examples)]
    results = run_cases(rank, cases)
    results["counts"] = dict(counts)
    return results


@pytest.fixture(scope="module")
def examples():
    return _draw(EXAMPLES)


@pytest.fixture(scope="module")
def per_rank(examples):
    return spawn(_cases, WORLD, examples, timeout=900, collect=True)


def test_sequence_parallel_shards_fuzz(examples, per_rank):
    outcomes = merged([{k: v for k, v in r.items() if k != "counts"} for r in per_rank])
    failed = {k: v for k, v in outcomes.items() if v != "ok"}
    assert len(outcomes) == len(examples), f"{len(examples) - len(outcomes)} examples did not run"
    assert not failed, "\n\n".join(f"{k}\n{v}" for k, v in list(failed.items())[:3])
    counts = [r["counts"] for r in per_rank]
    assert all(c == counts[0] for c in counts[1:]), "the ranks met different outcomes"
    print("\nsequence-parallel fuzz outcomes (layout/source: outcome): count")
    for key, count in sorted(counts[0].items()):
        print(f"  {key}: {count}")
    assert sum(counts[0].values()) >= EXAMPLES // 2
    assert any("equals oracle" in k for k in counts[0]), counts[0]
    assert any("loss equals oracle" in k for k in counts[0]), counts[0]
