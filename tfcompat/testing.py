"""Tiny random-weight configs for every supported family, valid on every release in the matrix.

``tiny_config("glm4v")`` returns the installed transformers' own config class, built with a
few layers, a head_dim of 32 and mRoPE sections that add up to the rotary width, so the
model can be instantiated on a CPU in milliseconds. Nothing is downloaded.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from ._probe.families import family as _family
from ._probe.tiny import HEAD_DIM, TINY_SECTIONS, tiny_config  # noqa: F401 (public here)

__all__ = ["tiny_config", "tiny_model", "tiny_sequence", "tiny_pixels", "padded_batch", "model_class",
           "TINY_SECTIONS", "assert_close_to_model", "MODEL_RTOL", "MODEL_ATOL", "families", "FamilyInfo",
           "spawn_ranks"]

#: The tolerance of whole-model comparisons (logits, gradients, parameters after optimizer steps; a patched
#: packed row against upstream's padded batch, sharded ranks against one process), in fp32: the sums run in
#: another order, so the absolute part scales with the reference's largest magnitude. tfcompat's tests and
#: ``tfcompat check`` (``attention.packed``: max|diff| / max(1, max|want|) <= MODEL_RTOL) use it.
MODEL_RTOL = 1e-4
MODEL_ATOL = 3e-5

def model_class(model_type: str) -> type:
    """The installed transformers' LM class of a family (ForConditionalGeneration / ForCausalLM)."""
    fam = _family(model_type)
    module = importlib.import_module(fam.modeling)
    for name in (f"{fam.prefix}ForConditionalGeneration", f"{fam.prefix}ForCausalLM"):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"{fam.modeling} has no ForConditionalGeneration / ForCausalLM class")


def tiny_model(model_type: str, seed: int = 0, dtype: Any = None, **overrides: Any) -> Any:
    """A tiny random-weight model of ``model_type`` (fp32, eval mode, seeded)."""
    import torch

    torch.manual_seed(seed)
    model = model_class(model_type)(tiny_config(model_type, **overrides))
    return model.to(dtype or torch.float32).eval()


def tiny_sequence(model_type: str, *, text: int = 4, image: bool = False, video: bool = False,
                  image_first: bool = False, config: Any = None) -> list[int]:
    """Token ids of one sequence with an image (4x4 patches: 4 tokens at the tiny merge size 2) and/or a
    video (2 frames of 4x4 patches: 8 tokens), laid out as the family's processor lays them out; with
    ``config``, its token ids and its vision tower's merge size (1, 2 or 4) decide the tokens per frame."""
    fam = _family(model_type)
    ids = list(range(10, 10 + text))
    cfg = tiny_config(model_type) if config is None else config
    merge = int(getattr(getattr(cfg, "vision_config", None), "spatial_merge_size", None) or 2)
    per_frame = 16 // merge ** 2
    glm = fam.video_frames_as_image_tokens

    def image_tokens():
        if glm:
            return [cfg.image_start_token_id] + [cfg.image_token_id] * per_frame + [cfg.image_end_token_id]
        return [cfg.vision_start_token_id] + [cfg.image_token_id] * per_frame + [cfg.vision_end_token_id]

    def video_tokens():
        if glm:
            return [cfg.video_start_token_id] + image_tokens() * 2 + [cfg.video_end_token_id]
        if fam.video_block_per_frame:
            return ([cfg.vision_start_token_id] + [cfg.video_token_id] * per_frame + [cfg.vision_end_token_id]) * 2
        return [cfg.vision_start_token_id] + [cfg.video_token_id] * 2 * per_frame + [cfg.vision_end_token_id]

    if image:
        ids = image_tokens() + ids if image_first else ids[:2] + image_tokens() + ids[2:]
    if video:
        ids = ids + video_tokens() + [20]
    return ids


def tiny_pixels(images: int = 0, videos: int = 0, seed: int = 0) -> dict:
    """pixel_values / grids for ``images`` images and ``videos`` videos of :func:`tiny_sequence`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    patch_dim = 3 * 2 * 4 * 4
    if images:
        out["pixel_values"] = torch.randn(16 * images, patch_dim, generator=g)
        out["image_grid_thw"] = torch.tensor([[1, 4, 4]] * images)
    if videos:
        out["pixel_values_videos"] = torch.randn(32 * videos, patch_dim, generator=g)
        out["video_grid_thw"] = torch.tensor([[2, 4, 4]] * videos)
    return out


def padded_batch(rows: Any) -> tuple:
    """``(input_ids, attention_mask)`` of token rows, right-padded with id 0: the batch the unpatched model (the
    oracle) runs, of rows such as :func:`tiny_sequence` gives.

    .. versionadded:: 0.1.0
    """
    import torch

    length = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), length), dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def assert_close_to_model(got: Any, want: Any, what: str = "") -> None:
    """``torch.testing.assert_close`` with the whole-model tolerance (:data:`MODEL_RTOL`, :data:`MODEL_ATOL`
    times ``max(1, max|want|)``); ``what`` prefixes the message."""
    import torch

    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=MODEL_RTOL, atol=MODEL_ATOL * scale, msg=lambda m: f"{what}: {m}")


@dataclasses.dataclass(frozen=True)
class FamilyInfo:
    """What a test or a framework needs to pick among the families (:func:`families`)."""

    name: str
    #: a vision-language model (text settings under ``text_config``)
    vision: bool
    #: an omni thinker with an audio tower
    audio: bool
    #: "none", "contiguous" (Qwen2-VL, GLM-4V T/H/W blocks) or "interleaved" (Qwen3-VL, Qwen3.5)
    mrope: str
    #: the decoder has no rotary embedding (apply_rope and rope_parameters refuse it by name)
    nope: bool
    #: why ``tfcompat.patch`` / ``tfcompat.embeds`` refuse it ("" when they serve it)
    patch_refusal: str
    embeds_refusal: str
    #: the family whose decoder a composite runs (GLM-4.6V runs GLM-4V's), else its own name
    text_family: str
    #: the first transformers release that ships it, and its modeling module
    since: str
    modeling: str


def families(installed_only: bool = True) -> dict:
    """The families tfcompat knows, by name: :class:`FamilyInfo` (vision, audio, mRoPE layout, NoPE, why patch or
    embeds refuse it, its text family, the first release shipping it). ``installed_only``: only the families the
    installed transformers ships.

    .. versionadded:: 0.2.0
    """
    from ._probe.families import FAMILIES
    from ._probe.resolve import installed_families

    out = {}
    for n in installed_families() if installed_only else FAMILIES:
        fam = FAMILIES[n]
        out[n] = FamilyInfo(n, fam.vision, "audio_config" in fam.tiny_top, fam.mrope, fam.nope, fam.patch_refusal,
                            fam.embeds_refusal, fam.text_family or n, fam.since, fam.modeling)
    return out


def _rank_entry(rank, fn, world, init, folder, args, threads, launcher_env, init_timeout):
    import datetime
    import json
    import os
    import sys

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if launcher_env:  # what torchrun sets: accelerate (transformers.Trainer) finds the process group by them
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT="29556")
    outcome: dict = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=init_timeout))
        result = fn(rank, world, *args)
        dist.barrier()  # nobody leaves while a peer still reads its last message
        outcome["result"] = result
    except Exception as exc:  # the caller says it, with the rank
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        outcome["error"] = f"{type(exc).__name__}: {first}"
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)
    # gloo's transport threads can abort the interpreter's teardown ("terminate called without an active
    # exception"); the outcome is written, so leave without tearing down
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(fn: Any, world: int, *args: Any, timeout: float = 600.0, threads: int = 1,
                start_method: str = "spawn", launcher_env: bool = False, init_timeout: float = 180.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` spawned processes joined in one gloo process group (a file
    rendezvous in a temporary folder: no port), for distributed checks on a CPU. Each rank's outcome comes back in
    rank order: ``{"rank": r, "result": <fn's JSON-able return value>}``, or ``{"rank": r, "error": "..."}`` where
    ``fn`` raised, the rank died, or the ranks ran past ``timeout`` seconds (then every rank is killed: a run
    ends by its timeout, never hangs). ``fn`` must be importable by the spawned processes (a module-level
    function). ``threads``: torch threads a rank; ``launcher_env``: set the variables torchrun sets (RANK,
    WORLD_SIZE, ...), which accelerate and transformers.Trainer read. tfcompat's tests, benchmarks and
    ``tfcompat check --ulysses/--context`` run their ranks with it.

    .. versionadded:: 0.2.0
    """
    import json
    import os
    import tempfile
    import time

    import torch.multiprocessing as mp

    folder = tempfile.mkdtemp(prefix="tfcompat-ranks-")
    ctx = mp.start_processes(_rank_entry, args=(fn, world, "file://" + os.path.join(folder, "rendezvous"), folder,
                                                args, threads, launcher_env, init_timeout),
                             nprocs=world, join=False, start_method=start_method)
    deadline = time.monotonic() + timeout
    late = None
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            late = f"the {world} ranks did not finish in {timeout:.0f}s (killed)"
            break
    outcomes = []
    for rank in range(world):
        try:
            with open(os.path.join(folder, f"rank{rank}.json")) as f:
                outcomes.append(json.load(f))
        except OSError:
            outcomes.append({"rank": rank, "error": late or "the rank wrote no outcome (it died)"})
    return outcomes
