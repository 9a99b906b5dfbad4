"""The plans a resolution carries (small frozen facts a probe derived: picklable, ``asdict``-able), and the
:class:`Resolution` that carries them."""

import dataclasses
import functools
from typing import Optional

from .source import _load


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
    #: the config attribute the default init takes the rotary width from where it is not head_dim (GLM-MoE-DSA on
    #: 5.10: "qk_rope_head_dim"); "" where it reads head_dim (or hidden_size // num_attention_heads)
    dim_key: str = ""


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
class CarrierPlan:
    """How a packed step reaches the registered attention function on the interface route."""

    #: the text model hands its ``**kwargs`` to every decoder layer and the layer hands them to its attention: the
    #: step rides there, as ``cu_seq_lens_q`` does (read from the source); else on the rotary module's output
    kwargs_reach: bool
    #: the decoder layer class the text model builds (read from its ``__init__``)
    layer: str = ""
    #: the text model takes its masks ready-made in ``attention_mask``, a dict by layer type (as generate() hands
    #: them): a packed step hands it None for every type, so upstream builds no (tokens, tokens) mask for the row
    masks_by_type: bool = False


@dataclasses.dataclass(frozen=True)
class RopeIndexPlan:
    """Where the installed release computes a vision family's mRoPE position ids."""

    #: the class whose ``get_rope_index`` tfcompat.embeds.rope_index calls
    owner: str
    #: whether it splits each video grid per frame itself (Qwen3-VL gives every frame its own vision block)
    splits_frames: bool
    params: tuple


@dataclasses.dataclass(frozen=True)
class Resolution:
    """One decision: what tfcompat uses for ``capability`` on the installed transformers."""

    capability: str
    #: short name of the chosen implementation
    impl: str
    #: dotted path of the upstream object it came from ("" when bundled)
    source: str
    #: which probe decided, in words
    reason: str
    #: installed transformers version
    transformers: str
    #: small, family-specific facts derived by the probe (a frozen dataclass or None)
    plan: object = None
    #: where the upstream object lives, ``(module, "attr.attr")``; () when there is none
    locator: tuple = dataclasses.field(default=(), compare=False, repr=False)

    @functools.cached_property
    def target(self):
        """The upstream object itself (a function, class or module), imported on first use: deciding
        needs only the source text, so ``report`` imports neither torch nor transformers."""
        return _load(self.locator) if self.locator else None

    def __reduce__(self):
        # the imported target is not part of the value: a pickled or deep-copied record carries the
        # decision and its locator, and imports the object again where it is needed
        return (Resolution, (self.capability, self.impl, self.source, self.reason, self.transformers, self.plan,
                             self.locator))

    def as_dict(self):
        plan = dataclasses.asdict(self.plan) if dataclasses.is_dataclass(self.plan) else self.plan
        return {
            "capability": self.capability,
            "impl": self.impl,
            "source": self.source,
            "reason": self.reason,
            "transformers": self.transformers,
            "plan": plan,
        }
