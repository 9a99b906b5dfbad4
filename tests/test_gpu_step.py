"""bench/gpu_step.py's dry run (``--device cpu --tiny``): every path of the GPU measurement runs on small shapes,
each tfcompat path's loss equals the unpatched model's on the padded batch, and the script exits 1 when one does
not (a tolerance made negative). The timings it prints on the CPU mean nothing; on a GPU the same script is the
measurement (docs/gpu.md)."""

import os
import re
import subprocess
import sys

from _helpers import ONCE

pytestmark = ONCE  # the bench's plumbing: run once in the matrix (tf525), every local run runs it

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*extra):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_step.py"), "--device", "cpu", "--tiny",
                           "--tokens", "96", *extra], capture_output=True, text=True, env=env, timeout=600)


def test_the_gpu_step_bench_runs_every_path_on_the_cpu():
    out = _run()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for shape in ("qwen2_5_vl-7b", "qwen3-8b"):
        assert any(line.startswith(f"step {shape}, 96 tokens") for line in lines), out.stdout
        assert any(line.startswith(f"rope {shape}, 96 tokens") for line in lines), out.stdout
    patched = [line for line in lines if line.strip().startswith("patched (")]
    # eager and compiled, 2 shapes, each with its tokens/s (a path that could not run prints "-" and why)
    assert len(patched) == 4 and all(re.match(r"\s*patched \(\w+\)(, compiled)?\s+\d+ ", line) for line in patched), \
        patched
    assert "every exact path equals the padded batch: PASS" in out.stdout


def test_the_gpu_step_bench_fails_a_path_off_the_padded_batch():
    out = _run("--tol", "-1", "--only", "step")
    assert out.returncode == 1 and "FAIL: " in out.stdout, out.stdout[-2000:]
