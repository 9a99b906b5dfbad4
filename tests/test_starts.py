"""Where a sequence starts, read eagerly and under torch.compile (twins that name each other): every row of up to 5
text positions in 0..3 (1,364 rows), every padding of them and every boundary list through both readings: the same
starts, or both refuse."""

import itertools

import torch

from tfcompat._attention.starts import _traced_starts_of_positions, padded_starts, starts_of
from tfcompat._step.labels import label_starts, traced_label_starts
from tfcompat.errors import PackingError

from _helpers import ONCE

pytestmark = ONCE  # tfcompat's own tensor logic, no release moves it (per release: test_training's labels)

ROWS = [torch.tensor(r) for n in range(1, 6) for r in itertools.product(range(4), repeat=n)]


def _traced(fn, *args):
    """The traced reading's starts (token indices), or None where its device-side assertion refuses the row."""
    try:
        out = fn(*args)
    except RuntimeError as exc:
        assert "tfcompat (checked inside torch.compile)" in str(exc), exc
        return None
    return None if out is None else torch.nonzero(out.flatten()).flatten().tolist()


def test_starts_of_positions():
    """A row of positions alone: both readings start a sequence at the first token and at each later 0, and both
    refuse positions that go down without restarting at 0."""
    refused = 0
    for t in ROWS:
        try:
            eager = starts_of(t, None, "position ids")
        except PackingError:
            eager, refused = None, refused + 1
        assert eager == _traced(_traced_starts_of_positions, t), t.tolist()
    assert refused > 100  # the refusal is exercised


def test_starts_under_padding():
    """A padded row: the restarts of its real tokens (eagerly in the real tokens' order, traced in the row's)."""
    for t in ROWS[:340]:  # rows of up to 4 tokens, each with every padding
        for valid in itertools.product((False, True), repeat=len(t)):
            valid = torch.tensor(valid)
            if not valid.any():
                continue
            real = torch.nonzero(valid).flatten()
            eager = [int(real[i]) for i in padded_starts(t, valid)[1:]]
            traced = _traced(_traced_starts_of_positions, t, valid)
            assert eager == [i for i in traced if i != 0], (t.tolist(), valid.tolist())


def test_label_starts():
    """The labels' sequence starts after the first, from the position ids or from the boundaries a call names."""
    calls = [{"position_ids": t[None]} for t in ROWS]
    for n in range(1, 6):
        for cuts in itertools.chain.from_iterable(itertools.combinations(range(1, n), r) for r in range(n)):
            cu = torch.tensor([0, *cuts, n], dtype=torch.int32)
            seq_idx = torch.bucketize(torch.arange(n), cu[1:].long(), right=True)[None]
            calls += [{"cu_seq_lens_q": cu, "position_ids": torch.arange(n)[None]}, {"seq_idx": seq_idx}]
    for kwargs in calls:
        n = next(iter(kwargs.values())).shape[-1]
        try:
            eager = label_starts(kwargs, n)
        except PackingError:
            eager = None
        traced = _traced(traced_label_starts, kwargs, n)
        assert eager == traced or (eager == [] and traced is None), kwargs
