"""What each supported model family looks like: data only, no version branches.

A family is named by transformers' ``model_type`` of its top-level config. The
resolver (:mod:`.resolve`) turns these facts into decisions for the installed
release; nothing here imports transformers.
"""

import dataclasses
from typing import Optional, Union

from ..errors import ModelError, UnsupportedTransformersError

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
    #: "neox": rotate the two halves of the rotary width; "gptj": rotate adjacent pairs; "deinterleave":
    #: DeepSeek's layout (adjacent pairs in, the two halves out: MLA's rope_interleave); "none": NoPE
    rotation: str
    #: "none", "contiguous" (Qwen2-VL, GLM-4V T/H/W blocks), "interleaved" (Qwen3-VL, Qwen3.5)
    mrope: str = "none"
    #: mrope_section the modeling code falls back to when the config has none (None: no default;
    #: PROBE_ONLY: it changed between releases, so only the probe can tell and a failed probe is an error)
    default_mrope_section: Union[tuple, str, None] = None
    #: partial_rotary_factor the 5.x rotary module honours (4.x: every model reads the attribute);
    #: PROBE_ONLY where it changed between releases
    reads_partial_rotary: Union[bool, str] = False
    #: releases that build one sliding-window mask for every layer: ((first release that does not, when), ...),
    #: when ``"set"`` (wherever ``sliding_window`` is set) or ``"used"`` (where ``use_sliding_window`` is true too);
    #: measured against each release's eager attention (:func:`.transformers4.one_mask`)
    one_mask: tuple = ()
    #: releases that changed what the family computes from the same keys, whatever the file says (read from the
    #: wheels' modeling files: a rotation layout, a score function): ((drift record key, the part, the file's key that
    #: states which one it was trained with (true: the new one; "" where none does), first release of the new one,
    #: before, from), ...)
    code_changes: tuple = ()
    #: where ``reads_partial_rotary`` is PROBE_ONLY because it changed once: the first 5.x release whose rotary module
    #: no longer reads ``rope_parameters["partial_rotary_factor"]`` (read from the wheels), for a file another
    #: release saved
    partial_rotary_read_before: str = ""
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
    #: each video frame is a vision block of its own, between vision start/end tokens (Qwen3-VL, Qwen3.5)
    video_block_per_frame: bool = False
    #: the family whose text decoder this composite runs (GLM-4.6V runs GLM-4V's): rope and attention
    #: are resolved in that family's modeling module, under this family's name
    text_family: str = ""
    #: why tfcompat.patch cannot serve this family's attention ("": it can); rope still works
    patch_refusal: str = ""
    #: why tfcompat.embeds cannot serve this vision family's inputs ("": it can)
    embeds_refusal: str = ""
    #: the text decoder has no rotary position embedding (NoPE): apply_rope / rope_parameters refuse
    nope: bool = False
    # ---- tiny random-weight configs (tfcompat.testing): data, so adding a family is one entry
    #: text settings on top of the common tiny ones (experts, linear attention, MLA widths)
    tiny_text: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)
    #: the RoPE dict of the tiny config (mrope_section is added from tiny_section)
    tiny_rope: dict = dataclasses.field(default_factory=lambda: {"rope_type": "default"}, compare=False, hash=False)
    tiny_section: Optional[tuple] = None
    tiny_partial: Optional[float] = None
    #: vision settings on top of the common tiny ones; the value TEXT_HIDDEN is the text hidden size
    tiny_vision: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)
    #: further top-level settings of the tiny config (an omni thinker's audio_config)
    tiny_top: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @property
    def modeling(self):
        return f"transformers.models.{self.module}.modeling_{self.module}"

    @property
    def text_modeling(self):
        """The modeling module that defines the text decoder (attention, rotary) this family runs."""
        return FAMILIES[self.text_family].modeling if self.text_family else self.modeling

    @property
    def configuration(self):
        return f"transformers.models.{self.module}.configuration_{self.module}"


# Tiny-config building blocks shared by several entries (tfcompat.testing adds the common text settings).
#: Qwen2's line on 4.51 (one window mask wherever a window is set) and 4.52 (where it is used)
_ONE_MASK_QWEN2 = (((4, 52), "set"), ((4, 53), "used"))
_MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2, n_routed_experts=4, num_experts=4, n_shared_experts=1,
            first_k_dense_replace=1, shared_expert_intermediate_size=32, n_group=1, topk_group=1,
            decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[])
_LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
               linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"])
_MLA = dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32,
            index_n_heads=2, index_head_dim=16, index_topk=4, num_key_value_heads=4, head_dim=16)
_INTERLEAVED = {"rope_type": "default", "mrope_interleaved": True}
_QWEN_VL_ROPE = {"type": "mrope"}  # the spelling Qwen2-VL configs use (rewritten by the config class)
_GLM_VISION = dict(image_size=16)
_QWEN3_VISION = dict(num_position_embeddings=16, deepstack_visual_indexes=[0])
TEXT_HIDDEN = "text hidden size"
_AUDIO = dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=32,
              max_source_positions=32, n_window=4, output_dim=TEXT_HIDDEN)

_SPARSE = ("its attention selects keys per query with a learned top-k indexer (DeepSeek sparse attention); a packed "
           "varlen attention would attend to every key, so tfcompat does not patch it")
_MLA_REFUSAL = ("its multi-head latent attention (MLA) projects q/k and v to different widths through low-rank "
                "adapters; tfcompat's packed attention serves the q/k/v attention of the other families only")
_VQ_REFUSAL = ("GLM-Image generates images as VQ tokens: its decoder's inputs and targets come from a VQ tokenizer "
               "that tfcompat's packed vision-language forward does not cover")
_NOPE_REFUSAL = ("its decoder has no rotary position embedding (NoPE) and a sparse top-k indexer, hyper-connections "
                 "and linear attention that tfcompat's packed forward does not cover")
_NOPE_EMBEDS = ("its vision inputs are not yet compared with upstream's forward; build its embeddings with the "
                "model's own forward")

FAMILIES = {
    f.name: f
    for f in (
        Family("llama", "llama", "Llama", "LlamaAttention", "LlamaRotaryEmbedding", "neox",
               config_class="LlamaConfig"),
        Family("qwen2", "qwen2", "Qwen2", "Qwen2Attention", "Qwen2RotaryEmbedding", "neox",
               config_class="Qwen2Config", one_mask=_ONE_MASK_QWEN2),
        Family("qwen3", "qwen3", "Qwen3", "Qwen3Attention", "Qwen3RotaryEmbedding", "neox",
               config_class="Qwen3Config", one_mask=_ONE_MASK_QWEN2),
        Family("qwen2_moe", "qwen2_moe", "Qwen2Moe", "Qwen2MoeAttention", "Qwen2MoeRotaryEmbedding", "neox",
               config_class="Qwen2MoeConfig", tiny_text=_MOE, one_mask=(((5, 0), "used"),)),
        Family("qwen3_moe", "qwen3_moe", "Qwen3Moe", "Qwen3MoeAttention", "Qwen3MoeRotaryEmbedding", "neox",
               config_class="Qwen3MoeConfig", tiny_text=_MOE, one_mask=(((4, 53), "used"),)),
        Family("qwen3_next", "qwen3_next", "Qwen3Next", "Qwen3NextAttention", "Qwen3NextRotaryEmbedding", "neox",
               reads_partial_rotary=True, since="4.57.0", config_class="Qwen3NextConfig",
               tiny_text=dict(_MOE, **_LINEAR), tiny_partial=0.25),
        Family("glm", "glm", "Glm", "GlmAttention", "GlmRotaryEmbedding", "gptj",
               reads_partial_rotary=True, config_class="GlmConfig", tiny_partial=0.5),
        Family("glm4", "glm4", "Glm4", "Glm4Attention", "Glm4RotaryEmbedding", "gptj",
               reads_partial_rotary=True, config_class="Glm4Config", tiny_partial=0.5),
        Family("glm4_moe", "glm4_moe", "Glm4Moe", "Glm4MoeAttention", "Glm4MoeRotaryEmbedding", "neox",
               reads_partial_rotary=True, since="4.54.0", config_class="Glm4MoeConfig", tiny_text=_MOE,
               tiny_partial=0.5),
        Family("glm4_moe_lite", "glm4_moe_lite", "Glm4MoeLite", "Glm4MoeLiteAttention", "Glm4MoeLiteRotaryEmbedding",
               "deinterleave", reads_partial_rotary=True, since="5.0.0", config_class="Glm4MoeLiteConfig",
               patch_refusal=_MLA_REFUSAL, tiny_text=dict(_MOE, **_MLA)),
        Family("glm_moe_dsa", "glm_moe_dsa", "GlmMoeDsa", "GlmMoeDsaAttention", "GlmMoeDsaRotaryEmbedding",
               "deinterleave", reads_partial_rotary=PROBE_ONLY, since="5.3.0", config_class="GlmMoeDsaConfig",
               patch_refusal=_SPARSE,
               # the rotary module reads rope_parameters' partial_rotary_factor on 5.3-5.9 (the 5.6.2-5.9.0 wheels);
               # 5.10 takes qk_rope_head_dim, 5.11+ head_dim, whatever the factor
               partial_rotary_read_before="5.10",
               # NeoX halves (apply_rotary_pos_emb) on 5.3-5.10 in the attention and 5.3-5.12 in the indexer;
               # interleaved pairs (apply_rotary_pos_emb_interleave) from 5.11 and 5.13
               # (GLM-5/5.1's files state it: rope_interleave, indexer_rope_interleave true, which no release reads)
               code_changes=(("rotation_layout", "the attention's rope channels", "rope_interleave", "5.11",
                                  "NeoX halves", "interleaved pairs"),
                                 ("indexer_rotation_layout", "the indexer's rope channels", "indexer_rope_interleave",
                                  "5.13", "NeoX halves", "interleaved pairs"),
                                 # the indexer's scores through a ReLU before its top-k from 5.4 (5.3.0 and 5.4.0
                                 # wheels), which selects other keys; no file key states it
                                 ("indexer_scores", "the indexer's scores", "", "5.4", "used as computed",
                                  "passed through ReLU")),
               tiny_text=dict(_MOE, **_MLA)),
        Family("qwen2_vl", "qwen2_vl", "Qwen2VL", "Qwen2VLAttention", "Qwen2VLRotaryEmbedding", "neox",
               mrope="contiguous", default_mrope_section=PROBE_ONLY, aliases=("qwen2_vl_text",), vision=True,
               config_class="Qwen2VLConfig", text_config_class="Qwen2VLTextConfig", one_mask=_ONE_MASK_QWEN2,
               tiny_rope=_QWEN_VL_ROPE, tiny_section=(4, 6, 6),
               tiny_vision=dict(embed_dim=32, hidden_size=TEXT_HIDDEN, mlp_ratio=2)),
        Family("qwen2_5_vl", "qwen2_5_vl", "Qwen2_5_VL", "Qwen2_5_VLAttention", "Qwen2_5_VLRotaryEmbedding",
               "neox", mrope="contiguous", default_mrope_section=PROBE_ONLY,
               aliases=("qwen2_5_vl_text", "qwen2.5_vl", "qwen2_5vl"), vision=True,
               config_class="Qwen2_5_VLConfig", text_config_class="Qwen2_5_VLTextConfig", one_mask=_ONE_MASK_QWEN2,
               tiny_rope=_QWEN_VL_ROPE, tiny_section=(4, 6, 6),
               tiny_vision=dict(window_size=16, fullatt_block_indexes=[1], tokens_per_second=2)),
        Family("glm4v", "glm4v", "Glm4v", "Glm4vTextAttention", "Glm4vTextRotaryEmbedding", "gptj",
               mrope="contiguous", default_mrope_section=PROBE_ONLY, reads_partial_rotary=True,
               aliases=("glm4v_text", "glm4_1v"), since="4.53.3", vision=True,
               config_class="Glm4vConfig", text_config_class="Glm4vTextConfig", video_frames_as_image_tokens=True,
               tiny_section=(2, 3, 3), tiny_partial=0.5, tiny_vision=_GLM_VISION),
        Family("glm46v", "glm46v", "Glm46V", "Glm4vTextAttention", "Glm4vTextRotaryEmbedding", "gptj",
               mrope="contiguous", default_mrope_section=PROBE_ONLY, reads_partial_rotary=True,
               aliases=("glm4_6v",), since="5.0.0", vision=True, text_family="glm4v",
               config_class="Glm46VConfig", text_config_class="Glm4vTextConfig", video_frames_as_image_tokens=True,
               tiny_section=(2, 3, 3), tiny_partial=0.5, tiny_vision=_GLM_VISION),
        Family("glm4v_moe", "glm4v_moe", "Glm4vMoe", "Glm4vMoeTextAttention", "Glm4vMoeTextRotaryEmbedding",
               "neox", mrope="contiguous", default_mrope_section=PROBE_ONLY, reads_partial_rotary=True,
               aliases=("glm4v_moe_text", "glm4vmoe_text", "glm4vmoe", "glm4_5v"), since="4.56.0", vision=True,
               config_class="Glm4vMoeConfig", text_config_class="Glm4vMoeTextConfig",
               video_frames_as_image_tokens=True, tiny_text=_MOE, tiny_section=(2, 3, 3), tiny_partial=0.5,
               tiny_vision=_GLM_VISION),
        Family("glm_ocr", "glm_ocr", "GlmOcr", "GlmOcrTextAttention", "GlmOcrTextRotaryEmbedding", "gptj",
               mrope="contiguous", default_mrope_section=PROBE_ONLY, reads_partial_rotary=True,
               aliases=("glm_ocr_text",), since="5.3.0", vision=True,
               config_class="GlmOcrConfig", text_config_class="GlmOcrTextConfig", video_frames_as_image_tokens=True,
               tiny_section=(2, 3, 3), tiny_partial=0.5, tiny_vision=_GLM_VISION),
        Family("glm_image", "glm_image", "GlmImage", "GlmImageTextAttention", "GlmImageTextRotaryEmbedding", "neox",
               mrope="contiguous", default_mrope_section=(8, 12, 12), reads_partial_rotary=True,
               aliases=("glm_image_text",), since="5.0.0", vision=True, config_class="GlmImageConfig",
               text_config_class="GlmImageTextConfig", patch_refusal=_VQ_REFUSAL, embeds_refusal=_VQ_REFUSAL,
               tiny_section=(2, 3, 3),
               tiny_partial=0.5, tiny_vision=_GLM_VISION,
               tiny_top=dict(vq_config=dict(embed_dim=16, num_embeddings=32, latent_channels=16))),
        Family("glm5_next", "glm5_next", "Glm5Next", "Glm5NextTextAttention", "", "none", nope=True,
               aliases=("glm5_next_text",), since="5.17.0", vision=True, config_class="Glm5NextConfig",
               text_config_class="Glm5NextTextConfig", video_frames_as_image_tokens=True,
               patch_refusal=_NOPE_REFUSAL, embeds_refusal=_NOPE_EMBEDS,
               tiny_text=dict(_MOE, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, v_head_dim=32,
                              num_key_value_heads=4, index_n_heads=2, index_head_dim=16, index_topk=4, index_kpool=2,
                              linear_head_dim=16, linear_num_heads=4, hc_mult=2, hc_sinkhorn_iters=2,
                              layer_types=["linear_attention", "full_attention"], mlp_layer_types=None),
               tiny_vision=dict(image_size=16, projection_intermediate_size=64)),
        Family("qwen3_vl", "qwen3_vl", "Qwen3VL", "Qwen3VLTextAttention", "Qwen3VLTextRotaryEmbedding", "neox",
               mrope="interleaved", default_mrope_section=(24, 20, 20), aliases=("qwen3_vl_text",),
               since="4.57.0", vision=True, video_block_per_frame=True,
               config_class="Qwen3VLConfig", text_config_class="Qwen3VLTextConfig", deepstack=True,
               tiny_rope=_INTERLEAVED, tiny_section=(6, 5, 5), tiny_vision=_QWEN3_VISION),
        Family("qwen3_vl_moe", "qwen3_vl_moe", "Qwen3VLMoe", "Qwen3VLMoeTextAttention",
               "Qwen3VLMoeTextRotaryEmbedding", "neox", mrope="interleaved", default_mrope_section=(24, 20, 20),
               aliases=("qwen3_vl_moe_text",), since="4.57.0", vision=True, video_block_per_frame=True,
               config_class="Qwen3VLMoeConfig", text_config_class="Qwen3VLMoeTextConfig", deepstack=True,
               tiny_text=_MOE, tiny_rope=_INTERLEAVED, tiny_section=(6, 5, 5), tiny_vision=_QWEN3_VISION),
        Family("qwen3_5", "qwen3_5", "Qwen3_5", "Qwen3_5Attention", "Qwen3_5TextRotaryEmbedding", "neox",
               mrope="interleaved", default_mrope_section=(11, 11, 10), reads_partial_rotary=True,
               aliases=("qwen3_5_text", "qwen3.5"), since="5.2.0", vision=True, video_block_per_frame=True,
               config_class="Qwen3_5Config", text_config_class="Qwen3_5TextConfig",
               tiny_text=_LINEAR, tiny_rope=_INTERLEAVED, tiny_section=(2, 1, 1), tiny_partial=0.25,
               tiny_vision=dict(num_position_embeddings=16)),
        Family("qwen3_5_moe", "qwen3_5_moe", "Qwen3_5Moe", "Qwen3_5MoeAttention", "Qwen3_5MoeTextRotaryEmbedding",
               "neox", mrope="interleaved", default_mrope_section=(11, 11, 10), reads_partial_rotary=True,
               aliases=("qwen3_5_moe_text", "qwen3.5_moe"), since="5.2.0", vision=True, video_block_per_frame=True,
               config_class="Qwen3_5MoeConfig", text_config_class="Qwen3_5MoeTextConfig",
               tiny_text=dict(_MOE, **_LINEAR), tiny_rope=_INTERLEAVED, tiny_section=(2, 1, 1), tiny_partial=0.25,
               tiny_vision=dict(num_position_embeddings=16)),
        Family("qwen2_5_omni", "qwen2_5_omni", "Qwen2_5OmniThinker", "Qwen2_5OmniAttention",
               "Qwen2_5OmniRotaryEmbedding", "neox", mrope="contiguous", default_mrope_section=PROBE_ONLY,
               aliases=("qwen2_5_omni_thinker", "qwen2_5_omni_text"), since="4.52.0", vision=True,
               config_class="Qwen2_5OmniThinkerConfig", text_config_class="Qwen2_5OmniTextConfig",
               one_mask=_ONE_MASK_QWEN2,
               tiny_section=(4, 6, 6), tiny_vision=dict(window_size=16, fullatt_block_indexes=[1], tokens_per_second=2),
               tiny_top=dict(audio_config=_AUDIO, audio_token_index=240, audio_start_token_id=241,
                             audio_end_token_id=242)),
        Family("qwen3_omni_moe", "qwen3_omni_moe", "Qwen3OmniMoeThinker", "Qwen3OmniMoeThinkerTextAttention",
               "Qwen3OmniMoeThinkerTextRotaryEmbedding", "neox", mrope="interleaved",
               default_mrope_section=(24, 20, 20), aliases=("qwen3_omni_moe_thinker", "qwen3_omni_moe_text"),
               since="4.57.0", vision=True, deepstack=True, config_class="Qwen3OmniMoeThinkerConfig",
               text_config_class="Qwen3OmniMoeTextConfig", tiny_text=_MOE, tiny_section=(6, 5, 5),
               tiny_vision=_QWEN3_VISION,
               tiny_top=dict(audio_config=dict(_AUDIO, downsample_hidden_size=16, n_window=50,
                                               max_source_positions=1500),
                             audio_token_id=240, audio_start_token_id=241)),
        Family("qwen4_exp", "qwen4_exp", "Qwen4Exp", "Qwen4ExpTextAttention", "Qwen4ExpTextRotaryEmbedding", "neox",
               mrope="interleaved", default_mrope_section=(11, 11, 10), reads_partial_rotary=True,
               aliases=("qwen4_exp_text",), since="5.16.0", vision=True, video_block_per_frame=True,
               config_class="Qwen4ExpConfig", text_config_class="Qwen4ExpTextConfig", patch_refusal=_SPARSE,
               tiny_text=dict(_MOE, **_LINEAR, hc_lowrank=16, ngram_vocab_size_base=512,
                              make_ngram_vocab_size_divisible_by=8, heads_per_ngram=2, split_ngram_parts=4,
                              indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4,
                              indexer_compress_ratio=2),
               tiny_rope=_INTERLEAVED, tiny_section=(2, 1, 1), tiny_partial=0.25,
               tiny_vision=dict(num_position_embeddings=16)),
    )
}

_ALIASES = {alias: f.name for f in FAMILIES.values() for alias in (f.name,) + f.aliases}


def text_config(config):
    """The text config of a vision-language config, or ``config`` itself for text models.

    Flat Qwen2-VL configs (transformers < 4.52) have no ``text_config`` and are returned as is, and so are
    flat configs that carry a newer checkpoint's ``text_config`` as a plain dict (a config saved by 4.53 and
    loaded by 4.51: the release's model reads the flat keys and ignores the dict).
    """
    sub = config.__dict__.get("text_config", None)
    if sub is None:
        getter = getattr(config, "get_text_config", None)
        sub = getter() if callable(getter) else None
    return config if sub is None or isinstance(sub, dict) else sub


def family(name_or_config):
    """The :class:`Family` for a model_type string or a (top-level or text) config."""
    # getattr, not isinstance(config, str): torch.compile before 2.8 cannot trace isinstance on a config
    name = getattr(name_or_config, "model_type", name_or_config)
    if not isinstance(name, str):
        if isinstance(name_or_config, dict):
            raise ModelError(
                f"tfcompat: got a dict (config.json's contents, model_type {name_or_config.get('model_type')!r}); "
                f"transformers' rotary modules and attention read a config object, and so does tfcompat: pass "
                f"transformers.AutoConfig.for_model(**config_dict) (or the model's .config)")
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
