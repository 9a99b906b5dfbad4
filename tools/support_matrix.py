"""Build the README's support table from the reports the tox matrix wrote.

    python tools/support_matrix.py .tox/reports > matrix.md

A cell is "yes" when every capability of that family resolved on that release, "rope" when it resolved
and tfcompat.patch refuses the family (the family table says why), "nope" when the decoder has no rotary
at all (resolved as "none": apply_rope, rope_parameters and patch refuse it by name), "-" when the release
does not ship the family, and "no" when something failed to resolve.
"""

import json
import pathlib
import sys

from packaging.version import Version

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from tfcompat._probe.families import FAMILIES  # noqa: E402  (the checkout's own table, not an installed copy)

#: families whose attention tfcompat.patch refuses (the reason is in the family table)
REFUSED = {name for name, fam in FAMILIES.items() if fam.patch_refusal}
NOPE = {name for name, fam in FAMILIES.items() if fam.nope}


def main(folder):
    docs = [json.loads(p.read_text()) for p in sorted(pathlib.Path(folder).glob("*.json"))]
    docs = sorted((d for d in docs if d.get("transformers")), key=lambda d: Version(d["transformers"]))
    seen, unique = set(), []
    for d in docs:  # the canary may have run the same release as the newest pinned environment
        if d["transformers"] not in seen:
            seen.add(d["transformers"])
            unique.append(d)
    docs = unique
    families = []
    for d in docs:
        for r in d["resolutions"]:
            if ":" not in r["capability"]:  # not per family (varlen.backend)
                continue
            fam = r["capability"].split(":")[1]
            if fam not in families:
                families.append(fam)
    print("| family | " + " | ".join(d["transformers"] for d in docs) + " |")
    print("|---|" + "---|" * len(docs))
    for fam in families:
        cells = []
        for d in docs:
            mine = [r for r in d["resolutions"] if r["capability"].endswith(":" + fam)]
            ok = all(r["impl"] != "unsupported" for r in mine)
            cells.append("-" if not mine else "no" if not ok else "nope" if fam in NOPE else
                         "rope" if fam in REFUSED else "yes")
        print(f"| {fam} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".tox/reports")
