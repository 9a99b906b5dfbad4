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
VARIANTS = {**{(fam, name): kw for fam in ("qwen2", "qwen3") for name, kw in WINDOW.items()},
            **{(fam, "partial_half"): dict(partial_rotary_factor=0.5) for fam in ("llama", "qwen2", "qwen3")},
            ("glm4", "default"): {}, ("glm4", "partial_quarter"): dict(partial_rotary_factor=0.25),
            ("qwen2", "theta_1e6"): dict(rope_theta=1e6)}
SIZE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0)
TOKENS = 24  # longer than every window above
POSITIONS = list(range(TOKENS - 1, -1, -3))  # the logits kept (the last token, and every third before it)


def fill(model):
    """Weights drawn by parameter name: the same numbers on every release whose model has that parameter."""
    import torch

    with torch.no_grad():
        for name, p in model.state_dict().items():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p.copy_(torch.randn(p.shape, generator=g))  # unit scale: attention sharp enough for RoPE to show
    return model


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
            config = CONFIG_MAPPING[fam](**SIZE, **kw)
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
