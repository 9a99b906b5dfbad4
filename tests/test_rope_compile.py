"""The Triton RoPE kernel compiled for real GPUs with no GPU: Triton's own compiler and ptxas, run on this CPU over
every variant the launcher can produce (tools/compile_proof.py), for sm_80 (A100), sm_90 (H100/H200) and sm_100
(B200). Fails on a compile error, any spill byte, or more registers a thread than the launch is sized for.

Runs where triton is installed and the environment asks for it (tox: tf524-triton; both Triton environments pin the
same triton, so one compiles); the interpreter tests prove the arithmetic, this the machine code."""

import ast
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ASKED = os.environ.get("TFCOMPAT_COMPILE_PROOF") == "1"

pytestmark = pytest.mark.skipif(not _ASKED, reason="the compile proof runs where TFCOMPAT_COMPILE_PROOF=1 "
                                                   "(tox: tf524-triton)")


def _prove(arch, part, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # triton 3.9's default, said aloud (it warns otherwise)
    out = tmp_path / f"sm{arch}.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "compile_proof.py"), "--arch", str(arch),
                           "--part", part, "--json", str(out)], capture_output=True, text=True, env=env, timeout=900)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


# each target's variants in two halves (every other one), so the two pytest workers share the compiling evenly
@pytest.mark.parametrize("part", ["0/2", "1/2"])
@pytest.mark.parametrize("arch", [80, 90, 100])
def test_rope_kernel_compiles_for_the_gpu_without_spills(arch, part, tmp_path):
    proc, proof = _prove(arch, part, tmp_path)
    assert proof is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = proof["rows"]
    bad = [r for r in rows if r["error"] or r["spill_stores"] or r["spill_loads"] or r["registers"] is None
           or r["registers"] > proof["max_registers"]]
    assert not bad, "\n".join(f"{r['variant']} {r['target']}: {r}" for r in bad[:20])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(rows) >= 50 and all(r["target"] == f"sm_{arch}" for r in rows)
    # read from the compiler's IR: every program loads its tokens' cos/sin once (4 loads; 2 for GPT-J's half cos,
    # whose two channels are one) before the loops over the q and k heads (2 loads of x a head)
    for r in rows:
        want = 2 if r["variant"].startswith("gptj-half") else 4
        assert r["loads_per_token"] == want and r["loads_per_head"] >= 4, r


def test_the_enumeration_reaches_every_switch():
    """The variants the proof compiles (both halves; a variant Triton binds to the same signature, constants and
    attributes as an earlier one is that kernel, compiled once) reach every switch of the kernel: every plan, mode,
    dtype pair and shape class."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import compile_proof
    finally:
        sys.path.pop(0)
    enumerated = compile_proof.variants()
    labels = " ".join(v[0] for v in enumerated)
    for part in ("neox ", "neox-mrope3", "gptj-half", "gptj-pairs ", "gptj-pairs-mrope3", "deinterleave", " fwd ",
                 " bwd ", "fwd-inplace", "float32/float32", "bfloat16/bfloat16", "float16/float16",
                 "bfloat16/float32", "float16/float32", " train", " decode", " d256 rd64 ", " d192 ", " d80 "):
        assert part in labels + " ", f"no compiled variant has {part!r}"
    assert len(enumerated) >= 100


def test_the_proof_fails_a_spilling_launch(tmp_path):
    """The proof sees what it is there for: a launch of 8192 pairs a program (64 a thread; the interpreter's tile
    is 4096) does not fit the 128-register budget on sm_90 and spills, and the verdict says so."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    code = ("import sys; sys.path.insert(0, 'tools'); import compile_proof as cp; "
            "from tfcompat._rope import fused as rt; rt._PAIRS = 8192; "
            "rows, limit = cp.prove((90,), only='neox d128 rd128 bfloat16/bfloat16 fwd train'); "
            "print([cp.verdict(r, limit) for r in rows])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdicts = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert len(verdicts) == 1 and ("spills" in verdicts[0] or "registers >" in verdicts[0]), verdicts
