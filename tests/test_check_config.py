"""`tfcompat check --config` on the configs published checkpoints ship, and `--model` on local checkpoints.

Each config is loaded as `from_pretrained` loads it on the installed release, scaled down with every setting that
decides RoPE and attention kept, and run through every check (upstream is the oracle); a checkpoint folder is
loaded with its weights (`from_pretrained`, safetensors).
"""

import json
import pathlib

import pytest

from tfcompat._tools.cli import main  # private: the command's own entry (tests of the command run it in process)

from _helpers import ONCE, SPAWNED_RANKS, installed

DATA = pathlib.Path(__file__).resolve().parent / "data"
CONFIGS = sorted((DATA / "configs").glob("*.json"))


def _run(capsys, *argv):
    capsys.readouterr()  # what the test printed before (save_pretrained with DeepSpeed installed logs a line)
    code = main(["check", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_the_catalogue_is_there():
    assert len(CONFIGS) >= 15 and (DATA / "configs" / "SOURCES.md").is_file()
    listed = (DATA / "configs" / "SOURCES.md").read_text()
    assert all(path.name in listed for path in CONFIGS), "every config cites its model id in SOURCES.md"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_published_config_passes_every_check(path, capsys):
    from tfcompat._probe.families import family  # private: the family table's own look-up

    model_type = json.loads(path.read_text())["model_type"]
    if model_type not in installed():
        pytest.skip(f"transformers of this environment has no {model_type}")
    code, doc = _run(capsys, "--config", str(path))
    if path.stem.endswith("--trimmed") and "itself cannot run this config" in doc.get("error", ""):
        # a trimmed file as what it is: Qwen3-VL without rope_scaling on 4.57 (its rotary module reads
        # rope_scaling["mrope_section"] unguarded): no oracle, said as one line, exit 2 (SOURCES.md)
        assert code == 2 and not doc["passed"], doc
        return
    if "drift" in doc:
        # a config nested by a newer release (text_config) on a release whose VL configs are flat: its model reads
        # the top-level keys, which the file may set otherwise (Qwen2.5-VL saved by 4.53: sliding_window 32768 at
        # the top, none in text_config); said, exit 2, no check run
        import importlib

        fam = family(model_type)
        flat = not hasattr(importlib.import_module(fam.configuration), f"{fam.prefix}TextConfig")
        keys = [d["key"] for d in doc["drift"]]
        if all(k in ("rotation_layout", "indexer_rotation_layout", "indexer_scores") for k in keys):
            # GLM-5/5.1 state rope_interleave / indexer_rope_interleave: true; 5.3-5.10 rotate the attention's rope
            # channels (5.3-5.12 the indexer's) as NeoX halves whatever the file says; GLM-5.1 was saved by 5.4.0,
            # whose indexer passes its scores through a ReLU that 5.3 lacks (the installed class's own source)
            import inspect

            from packaging.version import Version

            module = importlib.import_module(fam.modeling)
            indexer = inspect.getsource(getattr(module, f"{fam.prefix}Indexer").forward)
            attention = inspect.getsource(getattr(module, f"{fam.prefix}Attention").forward)
            expected = {"rotation_layout": "apply_rotary_pos_emb_interleave(" not in attention,
                        "indexer_rotation_layout": "apply_rotary_pos_emb_interleave(" not in indexer,
                        "indexer_scores": "relu(" not in indexer
                        and Version(json.loads(path.read_text()).get("transformers_version", "0")) >= Version("5.4")}
            for key, drifts in expected.items():
                assert (key in keys) == drifts, (key, doc["drift"])
            assert code == 2
            return
        assert code == 2 and flat and keys and all(k.startswith("text_config.") for k in keys), doc["drift"]
        return
    failed = [r for r in doc["results"] if not r["passed"]]
    assert code == 0 and doc["passed"] and not failed, failed
    packed = next(r for r in doc["results"] if r["check"] == "attention.packed")
    refusal = family(model_type).patch_refusal  # MLA (GLM-4.7-Flash), DeepSeek sparse attention (GLM-5): said
    assert packed["skipped"] is None if not refusal else refusal in packed["skipped"], packed
    assert doc["kept"], "the scaled model reports what it kept"
    # a kept RoPE dict shows rope_type, not also the legacy 'type' alias transformers keeps beside it
    for key in ("rope_parameters", "rope_scaling"):
        shown = doc["kept"].get(key, "")
        assert not ("'rope_type'" in shown and "'type'" in shown), (key, shown)


def test_a_family_this_release_lacks_names_the_first_release_with_it(capsys):
    """A published config of a family the installed release does not ship: tfcompat's one line naming the first
    release that has it (the family table's `since`), exit 2, not transformers' "does not recognize"."""
    from tfcompat._probe.families import family  # private: the family table's own look-up

    missing = [p for p in CONFIGS if json.loads(p.read_text())["model_type"] not in installed()]
    if not missing:
        pytest.skip("this release ships every catalogued family")
    for path in missing:
        fam = family(json.loads(path.read_text())["model_type"])
        assert main(["check", "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"first shipped in transformers {fam.since}" in err and "does not recognize" not in err, err


def test_checkpoint_saved_by_an_older_release(capsys):
    """A tiny Qwen2 saved by transformers 4.51.3 (safetensors), loaded with its weights by this release."""
    code, doc = _run(capsys, "--model", str(DATA / "checkpoints" / "qwen2-saved-by-4.51.3"))
    assert code == 0 and doc["passed"], [r for r in doc["results"] if not r["passed"]]


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_5"])
def test_checkpoint_this_release_saves(name, tmp_path, capsys):
    from tfcompat.testing import tiny_model

    if name not in installed():
        pytest.skip("not in this release")
    tiny_model(name).save_pretrained(tmp_path)
    code, doc = _run(capsys, "--model", str(tmp_path))
    assert code == 0 and doc["passed"], [r for r in doc["results"] if not r["passed"]]
    assert any(r["check"] == "attention.packed" and r["skipped"] is None for r in doc["results"])


def test_a_config_tfcompat_cannot_serve_says_why(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    code, doc = _run(capsys, "--config", str(tmp_path))
    assert code == 2 and not doc["passed"] and "does not cover model_type 'gpt2'" in doc["error"]
    code, doc = _run(capsys, "--config", str(tmp_path / "missing.json"))
    assert code == 2 and "no such file or folder" in doc["error"]
    (tmp_path / "bad.json").write_text("{not json")
    code, doc = _run(capsys, "--config", str(tmp_path / "bad.json"))
    assert code == 2 and "is not a JSON config" in doc["error"]


def test_a_config_upstream_itself_cannot_run_says_so(tmp_path, capsys):
    """A string rope_theta (a hand-edited config.json): upstream's own rotary module raises on it, so there is no
    oracle; one line naming upstream's failure and exit 2, not "5 failed" with raw errors."""
    if "qwen2" not in installed():
        pytest.skip("not in this release")
    config = json.loads((DATA / "configs" / "Qwen__Qwen2-0.5B-Instruct.json").read_text())
    config["rope_theta"] = str(config.get("rope_theta", 1000000.0))
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = main(["check", "--config", str(tmp_path)])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and "itself cannot run this config" in lines[0] and "TypeError" in lines[0]


def test_layouts_line_names_the_degrees_the_real_heads_allow(capsys):
    """`check --config` says which sequence-parallel degrees the model's real head counts allow (what
    tfcompat.patch accepts): Qwen2.5-VL-7B's 28 query / 4 kv heads take Ulysses 1, 2, 4, 7, 14, 28 (kv heads
    repeated for 7, 14, 28) and context parallelism at any degree; Qwen3.5's linear-attention layers take
    neither."""
    cases = {"Qwen__Qwen2.5-VL-7B-Instruct--saved-by-4.53.1": ([1, 2, 4, 7, 14, 28], [7, 14, 28], True),
             "ArliAI__Qwen3.5-27B-Derestricted": ([1], [], False)}
    ran = 0
    for stem, (ulysses, repeated, context) in cases.items():
        path = DATA / "configs" / f"{stem}.json"
        if json.loads(path.read_text())["model_type"] not in installed():
            continue
        code, doc = _run(capsys, "--config", str(path))
        if "drift" in doc:
            continue  # said before any check (test_published_config_passes_every_check)
        got = doc["layouts"]
        assert (got["ulysses"], got["kv_repeated"], got["context"]) == (ulysses, repeated, context), got
        ran += 1
    if not ran:
        pytest.skip("this release has neither family (or reads their files otherwise)")


@SPAWNED_RANKS
@ONCE  # the command's path over spawned ranks; the 2-D mesh itself runs on every spawning environment (test_mesh)
@pytest.mark.parametrize("stem", ["Qwen__Qwen3-8B", "Qwen__Qwen2.5-VL-7B-Instruct--saved-by-4.53.1"])
def test_ulysses_times_context_over_spawned_ranks(stem, capsys):
    """`check --config PATH --ulysses 2 --context 2`: the scaled model's packed step over 4 spawned gloo ranks on
    one DeviceMesh (the VL row whole on every rank, with its images) equals the single-process padded model
    (logits; gradients summed over the ranks). Breaking the step (patching without the context group) made this
    check fail with max|diff| 1.25 on Qwen3."""
    path = DATA / "configs" / f"{stem}.json"
    if json.loads(path.read_text())["model_type"] not in installed():
        pytest.skip("not in this release")
    code, doc = _run(capsys, "--config", str(path), "--ulysses", "2", "--context", "2")
    if "drift" in doc:
        pytest.skip("this release reads the file otherwise (test_published_config_passes_every_check)")
    layout = [r for r in doc["results"] if r["check"] == "layout.ulysses2.context2"]
    assert code == 0 and len(layout) == 1 and layout[0]["passed"], layout
    assert doc["changed"]["heads"]["to"] == ("8/2" if stem.endswith("8B") else "14/2"), doc["changed"]["heads"]


def test_a_layout_the_real_heads_refuse_says_why(capsys, tmp_path):
    """Degrees the real model cannot run: exit 2 before anything is spawned, naming the degrees it can."""
    vl = DATA / "configs" / "Qwen__Qwen2.5-VL-7B-Instruct--saved-by-4.53.1.json"
    hybrid = DATA / "configs" / "ArliAI__Qwen3.5-27B-Derestricted.json"
    assert main(["check", "--ulysses", "2"]) == 2
    assert "give --config PATH" in capsys.readouterr().err
    assert main(["check", "--config", str(vl), "--context", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err
    ran = 0
    for path, argv, says in ((vl, ["--ulysses", "8"], "8 does not divide the 28 query heads"),
                             (hybrid, ["--context", "2"], "linear-attention")):
        if json.loads(path.read_text())["model_type"] not in installed():
            continue
        code = main(["check", "--config", str(path), *argv])
        out = capsys.readouterr()
        err = out.err
        if "builds another RoPE" in out.out:
            continue  # this release reads the file otherwise: said before anything else
        assert code == 2 and says in err, err
        ran += 1
    if not ran:
        pytest.skip("this release has neither family")


def test_changed_settings_say_from_to_and_why(capsys):
    """Only values carried over are "kept"; the scaled ones are `changed X -> Y (why)` (heads, layers, widths,
    experts, vocabulary)."""
    path = DATA / "configs" / "Qwen__Qwen1.5-MoE-A2.7B-Chat.json"
    if "qwen2_moe" not in installed():
        pytest.skip("not in this release")
    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "kept heads" not in out and "changed heads 16/16 -> 2/2 (query/kv heads, the ratio 1 kept)" in out, out
    for line in ("changed num_experts 60 -> 8 (", "changed vocab_size 151936 -> 256 (",
                 "changed num_hidden_layers 24 -> 2 ("):
        assert line in out, out
    assert "imports and loading" in out.splitlines()[0]


def test_a_layout_this_machine_cannot_hold_is_refused_before_spawning():
    """`--context 64` started 64 processes (about 20 GB of 24 GB here, 5 min 48 s). The degrees are checked
    against the machine first: refused in one line naming how large a layout fits and a smaller one to run."""
    from tfcompat._tools.layout_check import rank_limit

    here = (2, 24.0)
    assert rank_limit(2, 2, here) == "" and rank_limit(2, 4, here) == ""
    for (u, c), smaller in (((1, 64), "--ulysses 1 --context 8"), ((16, 2), "--ulysses 4 --context 2"),
                            ((8, 2), "--ulysses 8 --context 1")):
        why = rank_limit(u, c, here)
        assert f"would start {u * c} processes" in why and "at most 8" in why and smaller in why, why
    assert "at most 2" in rank_limit(2, 2, (1, 0.5))  # at least the smallest layout is always allowed
    assert rank_limit(2, 1, (1, 0.5)) == ""


def test_check_refuses_a_layout_too_large_for_the_machine(capsys):
    path = DATA / "configs" / "Qwen__Qwen3-8B.json"
    if json.loads(path.read_text())["model_type"] not in installed():
        pytest.skip("not in this release")
    import time

    began = time.monotonic()
    code = main(["check", "--config", str(path), "--context", "64"])
    out = capsys.readouterr()
    if "builds another RoPE" in out.out:
        pytest.skip("this release reads the file otherwise")
    assert code == 2 and "would start 64 processes" in out.err and "the real heads allow" in out.err, out.err
    assert time.monotonic() - began < 120  # nothing was spawned
