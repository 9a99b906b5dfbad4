"""The plans a resolution carries: small frozen facts a probe derived (picklable, ``asdict``-able)."""

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class RopePlan:
    """How the installed attention of a family applies RoPE.

    rotation: "neox" (halves of the rotary width, ``rotate_half``), "gptj" (adjacent pairs) or
        "deinterleave" (DeepSeek/MLA: adjacent pairs in, halves out).
    cos_rows: 3 when cos/sin arrive unfolded as (3, batch, seq, dim) and the attention folds
        the mRoPE sections itself; 0 when they arrive folded as (batch, seq, dim).
    gptj_cos: for "gptj": "half" when the attention takes the first half of cos and
        repeat-interleaves it, "pairs" when cos already repeats each frequency twice.
    mrope: "none", "contiguous" or "interleaved" (where the sections are folded).
    """

    rotation: str
    cos_rows: int
    gptj_cos: str = ""
    mrope: str = "none"
    #: the upstream function rotates one tensor per call, ``fn(x, cos, sin)`` (GLM-5 on 5.3-5.5)
    single: bool = False


@dataclasses.dataclass(frozen=True)
class RopeInitPlan:
    """How the installed rotary module of a family builds ``inv_freq``."""

    #: "rope_parameters" (5.x) or "rope_scaling" (4.x): where the config keeps the RoPE dict
    config_key: str
    #: whether the default init honours partial_rotary_factor
    reads_partial_rotary: bool
    #: mrope_section the rotary module falls back to (None: no fallback)
    default_mrope_section: Optional[tuple] = None


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """What the installed text attention and text model of a family look like to the patched forwards."""

    params: tuple
    returns: int
    text_model: str
    four_row_ids: bool
    linear_attention: str
    #: the query projection also holds an output gate, interleaved per head (Qwen3-Next, Qwen3.5)
    gated_query: bool = False


@dataclasses.dataclass(frozen=True)
class RopeIndexPlan:
    """Where the installed release computes a vision family's mRoPE position ids."""

    #: the class whose ``get_rope_index`` tfcompat.embeds.rope_index calls
    owner: str
    #: whether it splits each video grid per frame itself (Qwen3-VL gives every frame its own vision block)
    splits_frames: bool
    params: tuple
