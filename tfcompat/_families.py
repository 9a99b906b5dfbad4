"""What each supported model family looks like: data only, no version branches.

A family is named by transformers' ``model_type`` of its top-level config. The
resolver (``_resolve.py``) turns these facts into decisions for the installed
release; nothing here imports transformers.
"""

import dataclasses

from .errors import UnsupportedTransformersError


PROBE_ONLY = "probe-only"


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    #: module under ``transformers.models``
    module: str
    #: class-name prefix used by the modeling file (``Qwen2VL`` -> ``Qwen2VLAttention``)
    prefix: str
    attention: str
    rotary: str
    #: "neox": rotate the two halves of the rotary width; "gptj": rotate adjacent pairs
    rotation: str
    #: "none", "contiguous" (Qwen2-VL, GLM-4V T/H/W blocks), "interleaved" (Qwen3-VL, Qwen3.5)
    mrope: str = "none"
    #: mrope_section the modeling code falls back to when the config has none (None: no default;
    #: PROBE_ONLY: it changed between releases, so only the probe can tell and a failed probe is an error)
    default_mrope_section: tuple = None
    #: partial_rotary_factor the 5.x rotary module honours (4.x: every model reads the attribute)
    reads_partial_rotary: bool = False
    #: model_type strings of the text config (and odd spellings seen in the wild)
    aliases: tuple = ()
    #: first transformers release that ships the model folder
    since: str = "4.51.3"
    #: True for vision-language families (text settings under ``text_config``)
    vision: bool = False
    #: classes of the top-level model, the text config, and the bare text model
    config_class: str = ""
    text_config_class: str = ""
    #: video frames are marked with the image token between video start/end tokens (GLM-4V, GLM-4.5V)
    video_frames_as_image_tokens: bool = False
    #: the vision tower returns per-layer deepstack features merged into early decoder layers (Qwen3-VL)
    deepstack: bool = False

    @property
    def modeling(self):
        return f"transformers.models.{self.module}.modeling_{self.module}"

    @property
    def configuration(self):
        return f"transformers.models.{self.module}.configuration_{self.module}"


FAMILIES = {
    f.name: f
    for f in (
        Family("llama", "llama", "Llama", "LlamaAttention", "LlamaRotaryEmbedding", "neox",
               config_class="LlamaConfig"),
        Family("qwen2", "qwen2", "Qwen2", "Qwen2Attention", "Qwen2RotaryEmbedding", "neox",
               config_class="Qwen2Config"),
        Family("qwen3", "qwen3", "Qwen3", "Qwen3Attention", "Qwen3RotaryEmbedding", "neox",
               config_class="Qwen3Config"),
        Family("glm", "glm", "Glm", "GlmAttention", "GlmRotaryEmbedding", "gptj",
               reads_partial_rotary=True, config_class="GlmConfig"),
        Family("glm4", "glm4", "Glm4", "Glm4Attention", "Glm4RotaryEmbedding", "gptj",
               reads_partial_rotary=True, config_class="Glm4Config"),
        Family("qwen2_vl", "qwen2_vl", "Qwen2VL", "Qwen2VLAttention", "Qwen2VLRotaryEmbedding", "neox",
               mrope="contiguous", default_mrope_section=PROBE_ONLY, aliases=("qwen2_vl_text",), vision=True,
               config_class="Qwen2VLConfig", text_config_class="Qwen2VLTextConfig"),
        Family("qwen2_5_vl", "qwen2_5_vl", "Qwen2_5_VL", "Qwen2_5_VLAttention", "Qwen2_5_VLRotaryEmbedding",
               "neox", mrope="contiguous", default_mrope_section=PROBE_ONLY,
               aliases=("qwen2_5_vl_text", "qwen2.5_vl", "qwen2_5vl"), vision=True,
               config_class="Qwen2_5_VLConfig", text_config_class="Qwen2_5_VLTextConfig"),
        Family("glm4v", "glm4v", "Glm4v", "Glm4vTextAttention", "Glm4vTextRotaryEmbedding", "gptj",
               mrope="contiguous", default_mrope_section=PROBE_ONLY, reads_partial_rotary=True,
               aliases=("glm4v_text", "glm4_1v"), since="4.53.3", vision=True,
               config_class="Glm4vConfig", text_config_class="Glm4vTextConfig", video_frames_as_image_tokens=True),
        Family("glm4v_moe", "glm4v_moe", "Glm4vMoe", "Glm4vMoeTextAttention", "Glm4vMoeTextRotaryEmbedding",
               "neox", mrope="contiguous", default_mrope_section=PROBE_ONLY, reads_partial_rotary=True,
               aliases=("glm4v_moe_text", "glm4vmoe_text", "glm4vmoe", "glm4_5v"), since="4.56.0", vision=True,
               config_class="Glm4vMoeConfig", text_config_class="Glm4vMoeTextConfig",
               video_frames_as_image_tokens=True),
        Family("qwen3_vl", "qwen3_vl", "Qwen3VL", "Qwen3VLTextAttention", "Qwen3VLTextRotaryEmbedding", "neox",
               mrope="interleaved", default_mrope_section=(24, 20, 20), aliases=("qwen3_vl_text",),
               since="4.57.0", vision=True,
               config_class="Qwen3VLConfig", text_config_class="Qwen3VLTextConfig", deepstack=True),
        Family("qwen3_vl_moe", "qwen3_vl_moe", "Qwen3VLMoe", "Qwen3VLMoeTextAttention",
               "Qwen3VLMoeTextRotaryEmbedding", "neox", mrope="interleaved", default_mrope_section=(24, 20, 20),
               aliases=("qwen3_vl_moe_text",), since="4.57.0", vision=True,
               config_class="Qwen3VLMoeConfig", text_config_class="Qwen3VLMoeTextConfig", deepstack=True),
        Family("qwen3_5", "qwen3_5", "Qwen3_5", "Qwen3_5Attention", "Qwen3_5TextRotaryEmbedding", "neox",
               mrope="interleaved", default_mrope_section=(11, 11, 10), reads_partial_rotary=True,
               aliases=("qwen3_5_text", "qwen3.5"), since="5.2.0", vision=True,
               config_class="Qwen3_5Config", text_config_class="Qwen3_5TextConfig"),
        Family("qwen3_5_moe", "qwen3_5_moe", "Qwen3_5Moe", "Qwen3_5MoeAttention", "Qwen3_5MoeTextRotaryEmbedding",
               "neox", mrope="interleaved", default_mrope_section=(11, 11, 10), reads_partial_rotary=True,
               aliases=("qwen3_5_moe_text", "qwen3.5_moe"), since="5.2.0", vision=True,
               config_class="Qwen3_5MoeConfig", text_config_class="Qwen3_5MoeTextConfig"),
    )
}

_ALIASES = {alias: f.name for f in FAMILIES.values() for alias in (f.name,) + f.aliases}


def family(name_or_config):
    """The :class:`Family` for a model_type string or a (top-level or text) config."""
    name = name_or_config
    if not isinstance(name, str):
        name = getattr(name_or_config, "model_type", None)
        if not isinstance(name, str):
            raise UnsupportedTransformersError(
                f"tfcompat: cannot tell the model family of {type(name_or_config).__name__}: it has no "
                f"model_type; pass model_type= (one of {', '.join(sorted(FAMILIES))})"
            )
    key = name.strip().lower().replace("-", "_")
    if key in _ALIASES:
        return FAMILIES[_ALIASES[key]]
    raise UnsupportedTransformersError(
        f"tfcompat does not cover model_type {name!r}; supported families: {', '.join(sorted(FAMILIES))}"
    )
