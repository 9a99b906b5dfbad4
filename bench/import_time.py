"""Cost of `import tfcompat`, and of the first apply_rope call, each in a fresh interpreter.

    python bench/import_time.py [--family qwen2_5_vl] [--repeats 5]

Prints medians: `import tfcompat` (target: under 20 ms, and
neither torch nor transformers loaded), importing the family's modeling module, and the first
apply_rope call after that import (resolution and probing; target: no more than the import).
Then `tfcompat report` (every family) against `import torch, transformers` alone, wall time of whole
fresh processes (target: report under 3 s, and below the bare import it no longer needs).
"""

import argparse
import statistics
import subprocess
import sys
import time

PROBE = r"""
import sys, time
t0 = time.perf_counter()
import tfcompat
t1 = time.perf_counter()
import tfcompat.rope, tfcompat.config
t1b = time.perf_counter()
assert "torch" not in sys.modules and "transformers" not in sys.modules
import torch, transformers, importlib
from tfcompat._probe.families import FAMILIES
from tfcompat.testing import tiny_config
fam = FAMILIES[sys.argv[1]]
t2 = time.perf_counter()
importlib.import_module(fam.modeling)
t3 = time.perf_counter()
cfg = tiny_config(fam.name)
from tfcompat._probe import resolve as _resolve
rot = getattr(importlib.import_module(fam.modeling), fam.rotary)(config=tfcompat.config.text_config(cfg))
pos = torch.arange(8).view(1, 1, 8).expand(3, 1, 8) if fam.vision else torch.arange(8)[None]
cos, sin = rot(torch.zeros(1), pos)
q = torch.randn(1, 2, 8, 32)
tfcompat.clear_cache()
t4 = time.perf_counter()
tfcompat.rope.apply_rope(q, q, cos, sin, config=cfg)
t5 = time.perf_counter()
print((t1 - t0) * 1e3, (t1b - t1) * 1e3, (t3 - t2) * 1e3, (t5 - t4) * 1e3)
"""


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen2_5_vl")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    tf, sub, mod, first = [], [], [], []
    for _ in range(args.repeats):
        out = subprocess.run([sys.executable, "-c", PROBE, args.family], capture_output=True, text=True, check=True)
        a, a2, b, c = map(float, out.stdout.split())
        tf.append(a)
        sub.append(a2)
        mod.append(b)
        first.append(c)
    m = statistics.median
    print(f"median of {args.repeats} fresh interpreters, family {args.family}")
    print(f"{'import tfcompat ms':>20}{'+ rope, config ms':>19}{'import modeling ms':>20}{'first apply_rope ms':>21}"
          f"{'first/import':>14}")
    print(f"{m(tf):20.2f}{m(sub):19.2f}{m(mod):20.1f}{m(first):21.1f}{m(first) / m(mod):14.2f}")
    report, bare = [], []
    for _ in range(args.repeats):
        for into, cmd in ((report, ["-m", "tfcompat", "report"]), (bare, ["-c", "import torch, transformers"])):
            start = time.perf_counter()
            subprocess.run([sys.executable, *cmd], capture_output=True, check=True)
            into.append(time.perf_counter() - start)
    print(f"{'tfcompat report s':>20}{'import torch+tf s':>19}{'report/import':>20}")
    print(f"{m(report):20.2f}{m(bare):19.2f}{m(report) / m(bare):20.2f}")


if __name__ == "__main__":
    main()
