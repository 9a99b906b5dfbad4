"""The ``tfcompat`` command: ``report``, ``check`` and ``vendor``.

JSON output (``--json``) is versioned by its ``"schema"`` key (currently 1); keys are only
ever added within a schema version.
"""

import argparse
import json
import os
import platform
import sys

from .. import __version__
from .common import _PROG, SCHEMA, _dist_version  # noqa: F401 (SCHEMA: the JSON schema, public here)


# ----------------------------------------------------------------------------- report
def _report(args):
    from .. import report, version
    from .._probe import resolve as _resolve

    doc = {
        "schema": SCHEMA,
        "tfcompat": __version__,
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
    else:
        _print_report(doc)
    return 1 if doc["error"] or any(r["impl"] == "unsupported" for r in doc["resolutions"]) else 0


def _print_report(doc):
    """The report as lines: versions, then one block per decision, at most 100 columns."""
    import textwrap

    print(f"tfcompat {doc['tfcompat']}  python {doc['python']}  torch {doc['torch']}  "
          f"transformers {doc['transformers']}  flash-attn {doc['flash_attn'] or '-'}")
    print(f"supported transformers: {doc['supported_range'][0]} .. {doc['supported_range'][1]} (newer: probed)")
    if doc.get("note"):
        print(textwrap.fill(doc["note"], 100, initial_indent="note: ", subsequent_indent="  "))
    for r in doc["resolutions"]:
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
