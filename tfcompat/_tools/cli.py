"""The ``tfcompat`` command: ``report``, ``check`` and ``vendor``.

JSON output (``--json``) is versioned by its ``"schema"`` key (currently 1); keys are only
ever added within a schema version.
"""

import argparse
import json
import os
import platform
import sys

from .. import __version__, _provenance
from .common import _PROG, SCHEMA, _dist_version  # noqa: F401 (SCHEMA: the JSON schema, public here)


# ----------------------------------------------------------------------------- report
def _report(args):
    from .. import report, version
    from .._probe import resolve as _resolve

    doc = {
        "schema": SCHEMA,
        "tfcompat": __version__,
        # where this copy came from: {"version", "commit", "made"} (a checkout, a wheel, a vendored copy)
        "provenance": _provenance.provenance(),
        "python": platform.python_version(),
        "torch": _dist_version("torch"),
        "transformers": _dist_version("transformers"),
        "flash_attn": _dist_version("flash-attn") or _dist_version("flash_attn"),
        "supported_range": [version.MIN_TRANSFORMERS, version.TESTED_MAX_TRANSFORMERS],
        "families": [],
        "resolutions": [],
        "error": None,
    }
    try:
        version.require_supported_transformers("tfcompat report")
        doc["families"] = _resolve.installed_families()
        doc["resolutions"] = [r.as_dict() for r in report()]
        doc["summary"] = _summary(doc)
        if version.transformers_version() > version._normalize(version.TESTED_MAX_TRANSFORMERS):
            doc["note"] = (f"transformers {doc['transformers']} is newer than the newest tested release "
                           f"{version.TESTED_MAX_TRANSFORMERS}; every choice below comes from probes")
    except Exception as exc:  # the report must still print what it knows
        doc["error"] = f"{type(exc).__name__}: {exc}"
    if args.output:
        if os.path.isdir(args.output):
            print(f"tfcompat report: --output {args.output} is a directory; pass a file path, e.g. "
                  f"{os.path.join(args.output, 'tfcompat-report.json')}", file=sys.stderr)
            return 2
        try:
            os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
            with open(args.output, "w") as fh:
                json.dump(doc, fh, indent=2, sort_keys=True)
        except OSError as exc:
            print(f"tfcompat report: cannot write --output {args.output}: {exc.strerror or exc}; pass a path in a "
                  f"writable folder", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:  # with --output the decisions are in the file: the log keeps the summary (a readable tail)
        _print_report(doc, decisions=not args.output)
        if args.output:
            print(f"{len(doc['resolutions'])} decisions written to {args.output}")
    return 1 if doc["error"] or any(r["impl"] == "unsupported" for r in doc["resolutions"]) else 0


def _summary(doc):
    """The decisions that matter, from the resolutions: the release against the tested range, the kernels per
    device, what carries the packed step, and which families are served how (``doc["summary"]``)."""
    from .. import version
    from .._probe.families import FAMILIES

    res = {r["capability"]: r for r in doc["resolutions"]}
    installed = [f for f in doc["families"] if f in FAMILIES]
    nope = [f for f in installed if FAMILIES[f].nope]
    rope_only = [f for f in installed if FAMILIES[f].patch_refusal and f not in nope]
    patched = [f for f in installed if f not in nope and f not in rope_only]
    low, high = doc["supported_range"]
    try:
        newer = version.transformers_version() > version._normalize(high)
    except Exception:  # no transformers: the error line says so
        newer = False
    rope = res.get("rope.impl", {}).get("impl", "-")
    varlen = res.get("varlen.backend", {}).get("impl", "-")
    return {
        "release": (f"transformers {doc['transformers']}: newer than the newest tested ({high}); every decision "
                    f"is probed" if newer else f"transformers {doc['transformers']}: in the tested range "
                    f"{low} .. {high}"),
        "kernels": (f"rope {rope.replace('=', ': ').replace(' cuda', ', cuda')}; packed attention: cpu and fp32 "
                    f"sdpa (exact, per sequence), cuda fp16/bf16 {varlen}"),
        "carrier": _carriers(res, patched),
        "families": (f"{len(installed)} on this release: {len(patched)} patched, {len(rope_only)} rope only"
                     + (f" ({', '.join(rope_only)})" if rope_only else "")
                     + (f", {len(nope)} without rope ({', '.join(nope)})" if nope else "")),
        "unsupported": ", ".join(r["capability"] for r in doc["resolutions"] if r["impl"] == "unsupported")
                       or "none",
    }


def _carriers(res, patched):
    """The summary's line on what carries a packed step, counted over the patched families' resolutions."""
    rows = [res.get(f"attention.carrier:{f}", {}) for f in patched]
    rides = sum(r.get("impl") == "interface" and bool((r.get("plan") or {}).get("kwargs_reach")) for r in rows)
    interface = sum(r.get("impl") == "interface" for r in rows)
    forward = sum(r.get("impl") == "forward" for r in rows)
    return (f"upstream's attention forward and AttentionInterface for {interface} families ({rides} with the step in "
            f"the layers' kwargs, {interface - rides} on the rotary output); tfcompat's bundled forward for {forward} "
            f"(a model loaded with flash attention, or patched with TFCOMPAT_ROPE_IMPL set, keeps the bundled forward)")


def _print_report(doc, decisions=True):
    """The report as lines: versions, a summary, then (``decisions``) one block per decision, at most 100
    columns."""
    import textwrap

    print(f"tfcompat {_provenance.describe()}")
    print(f"python {doc['python']}  torch {doc['torch']}  transformers {doc['transformers']}  "
          f"flash-attn {doc['flash_attn'] or '-'}")
    if doc.get("note"):
        print(textwrap.fill(doc["note"], 100, initial_indent="note: ", subsequent_indent="  "))
    if doc.get("summary"):
        print("summary:")
        for key, text in doc["summary"].items():
            print(textwrap.fill(text, 100, initial_indent=f"  {key:<12}", subsequent_indent=" " * 14,
                                break_on_hyphens=False))
        if decisions:
            print("decisions (capability: choice  (where upstream keeps it), then why):")
    for r in doc["resolutions"] if decisions else ():
        source = r["source"].replace("transformers.models.", "")
        head = f"{r['capability']}: {r['impl']}"
        if source and len(head) + len(source) + 5 <= 100:
            head += f"  ({source})"
        print(head)
        for line in textwrap.wrap(r["reason"], width=96, break_on_hyphens=False):
            print("    " + line)
    if doc["error"]:
        print("error:", doc["error"])


# ------------------------------------------------------------------------------- main
def _check(args):
    from .check_cmd import check

    return check(args)


def _vendor(args):
    from .vendor import vendor

    return vendor(args)


def build_parser():
    parser = argparse.ArgumentParser(prog=_PROG, description="Keep GLM/Qwen VLM training code correct across "
                                                             "transformers releases.")
    parser.add_argument("--version", action="version", version=f"tfcompat {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("report", help="versions and every resolver decision for the installed transformers")
    p.add_argument("--json", action="store_true", help="machine-readable output (schema 1)")
    p.add_argument("--output", metavar="FILE", help="also write the JSON document to FILE")
    p.set_defaults(func=_report)
    p = sub.add_parser("check", help="compare tfcompat against upstream on tiny random models, forward and backward")
    p.add_argument("--family", action="append", metavar="NAME", help="check only this family (repeatable)")
    p.add_argument("--json", action="store_true", help="machine-readable output (schema 1)")
    p.add_argument("--verbose", "-v", action="store_true", help="one line per check after the summary (a failed "
                   "check's line is always printed)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="override every check's absolute tolerance (a self-test of the failure path)")
    p.add_argument("--config", metavar="PATH",
                   help="check YOUR model: a config.json or checkpoint folder, scaled down keeping every setting "
                        "that decides RoPE and attention")
    p.add_argument("--model", metavar="PATH",
                   help="check a local checkpoint folder with its own weights (fp32 on CPU: small models)")
    p.add_argument("--ulysses", type=int, metavar="N", help="with --config: also run the packed step over N Ulysses "
                   "ranks (spawned, gloo) against the single-process padded model")
    p.add_argument("--context", type=int, metavar="M", help="with --config: ... over M context-parallel ranks "
                   "(with --ulysses: N x M ranks on one DeviceMesh)")
    p.add_argument("--device", metavar="DEV", help="run the checks on this device (cuda, cuda:1, cpu) with the "
                                                   "kernels auto picks there; exit 2 where it is not visible")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="with --device: the dtype (default bf16 on "
                                                                      "GPUs, fp32 on the CPU)")
    p.add_argument("--plan", action="store_true", help="with --device: print which kernels and checks would run "
                                                       "there, and run nothing (needs no device)")
    p.set_defaults(func=_check)
    p = sub.add_parser("vendor", help="copy the package into DEST (e.g. myproj/_vendor/tfcompat)")
    p.add_argument("dest", metavar="DEST")
    p.add_argument("--force", action="store_true", help="copy into a folder that is not an earlier tfcompat copy")
    p.add_argument("--only", choices=("rope", "config", "varlen", "patch"), help="copy one layer: rope "
                   "(apply_rope), config (rope_parameters, drift), varlen (pack, varlen_attention) or patch "
                   "(tfcompat.patch, packing, varlen, ulysses, embeds, rope, config, testing), each with the modules "
                   "it imports; no tools")
    p.add_argument("--no-tools", action="store_true", help="leave out the tools (this command, the checks, config "
                                                          "scaling): the compatibility layer alone")
    p.set_defaults(func=_vendor)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        status = args.func(args)
        sys.stdout.flush()  # into a pipe the output is buffered: a reader that left shows here
        return status
    except BrokenPipeError:
        # `tfcompat report | head`: the reader left; say nothing more (Python would print a traceback at exit)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # as a process ended by SIGPIPE
