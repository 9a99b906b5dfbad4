"""The drift sweep's data: tiny configs saved by the installed transformers release, with what its own model computes.

Run once per release whose files the sweep holds (each in an environment with that release installed):

    python tools/drift_sweep.py tests/data/drift

For every variant the installed release can build and run, it writes ``<family>-<variant>--saved-by-<release>/``:
``config.json`` (``save_pretrained``, as a user's checkpoint holds it) and ``logits.json``, the logits of this
release's own model with weights drawn by parameter name (:func:`fill`, the same on every release) on a row longer
than the windows. tests/test_drift.py loads every folder with the release of its environment, runs that release's
model on the same weights and row, and holds tfcompat's drift verdict to the difference: a drift where the logits
differ, none where they agree.
"""

import json
import os
import sys
import zlib

#: (family, variant) -> config keyword arguments (on the config class of the installed release)
WINDOW = {"w_none": dict(use_sliding_window=False, sliding_window=None),
          "w_off": dict(use_sliding_window=False, sliding_window=4, max_window_layers=1),
          "w_on0": dict(use_sliding_window=True, sliding_window=4, max_window_layers=0),
          "w_on1": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)}
#: YaRN with the factor explicit (the long-context recipe of the Qwen model cards: the factor is not
#: max_position_embeddings / original_max_position_embeddings = 4 here) and implicit (the two agree)
YARN = {"yarn_explicit": dict(factor=2.0, original_max_position_embeddings=16),
        "yarn_implicit": dict(factor=4.0, original_max_position_embeddings=16)}
MOE = dict(moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=4, n_routed_experts=4,
           num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
           decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[])
DSA = dict(MOE, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
           index_n_heads=2, index_head_dim=8, index_topk=4, num_key_value_heads=4)
VARIANTS = {**{(fam, name): kw for fam in ("qwen2", "qwen3") for name, kw in WINDOW.items()},
            **{(fam, "partial_half"): dict(partial_rotary_factor=0.5) for fam in ("llama", "qwen2", "qwen3")},
            ("glm4", "default"): {}, ("glm4", "partial_quarter"): dict(partial_rotary_factor=0.25),
            ("qwen2", "theta_1e6"): dict(rope_theta=1e6),
            **{(fam, name): dict(yarn=kw) for fam in ("qwen2", "qwen3") for name, kw in YARN.items()},
            **{("qwen2_moe", name): dict(MOE, **kw) for name, kw in WINDOW.items()},
            **{("qwen3_moe", name): dict(MOE, **WINDOW[name]) for name in ("w_none", "w_on1")},
            ("qwen3_moe", "yarn_explicit"): dict(MOE, yarn=YARN["yarn_explicit"]),
            ("glm4_moe", "default"): dict(MOE), ("glm4_moe", "partial_quarter"): dict(MOE, partial_rotary_factor=0.25),
            ("glm_moe_dsa", "default"): dict(DSA)}
SIZE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0)
TOKENS = 24  # longer than every window above
POSITIONS = list(range(TOKENS - 1, -1, -3))  # the logits kept (the last token, and every third before it)


def _draw(name, shape):
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g)  # unit scale: attention sharp enough for RoPE to show


def _experts(name, shape, hidden):
    """A 5.x fused experts' parameter (``experts.gate_up_proj``, ``experts.down_proj``) built from the weights 4.x
    draws for each expert's own ``gate_proj`` / ``up_proj`` / ``down_proj`` (the same experts on both majors), laid
    out as the parameter is (experts x out x in, or transposed)."""
    import torch

    prefix, part = name.rsplit(".", 1)
    n = shape[0]
    inner = shape[1] * shape[2] // hidden
    if part == "gate_up_proj":
        w = torch.stack([torch.cat([_draw(f"{prefix}.{e}.gate_proj.weight", (inner // 2, hidden)),
                                    _draw(f"{prefix}.{e}.up_proj.weight", (inner // 2, hidden))]) for e in range(n)])
    else:
        w = torch.stack([_draw(f"{prefix}.{e}.down_proj.weight", (hidden, inner)) for e in range(n)])
    return w if tuple(w.shape) == tuple(shape) else w.transpose(1, 2)


def fill(model):
    """Weights drawn by parameter name: the same numbers on every release whose model has that parameter (a 5.x
    fused experts' parameter from its experts' 4.x names)."""
    import torch

    hidden = model.config.get_text_config().hidden_size
    with torch.no_grad():
        for name, p in model.state_dict().items():
            fused = name.endswith(("experts.gate_up_proj", "experts.down_proj")) and p.dim() == 3
            p.copy_(_experts(name, p.shape, hidden) if fused else _draw(name, p.shape))
    return model


def _yarn_kwargs(yarn):
    """The YaRN settings as this release's config takes them (``rope_scaling`` on 4.x, ``rope_parameters`` on 5.x)."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, **yarn))
    return dict(rope_scaling=dict(rope_type="yarn", **yarn))


def row():
    import torch

    return (torch.arange(TOKENS) * 7 % 61 + 1)[None]


def logits(config):
    """This release's model of ``config`` (sdpa), filled by :func:`fill`, on :func:`row`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = fill(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")).eval()
    with torch.no_grad():
        return model(input_ids=row()).logits.float()[0, POSITIONS]


def save(out):
    import transformers
    from transformers import CONFIG_MAPPING

    release = transformers.__version__
    saved = []
    for (fam, variant), kw in VARIANTS.items():
        try:
            kw = dict(kw)
            kw.update(_yarn_kwargs(kw.pop("yarn")) if "yarn" in kw else {})
            config = CONFIG_MAPPING[fam](**dict(SIZE, **kw))
            want = logits(config)
        except Exception as exc:  # this release cannot build or run the variant: no file of it
            print(f"{fam}-{variant}: not on {release} ({type(exc).__name__}: {str(exc)[:80]})")
            continue
        folder = os.path.join(out, f"{fam}-{variant}--saved-by-{release}")
        config.save_pretrained(folder)
        with open(os.path.join(folder, "logits.json"), "w") as fh:
            json.dump([[float(f"{x:.6g}") for x in r] for r in want.tolist()], fh, separators=(",", ":"))
        saved.append(os.path.basename(folder))
    print(json.dumps({"release": release, "saved": saved}, indent=1))


if __name__ == "__main__":
    save(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "tests", "data",
                                                                "drift"))
