"""The ``tfcompat`` command: ``report``, ``check`` and ``vendor``.

JSON output (``--json``) is versioned by its ``"schema"`` key (currently 1); keys are only
ever added within a schema version.
"""

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import sys
import time

from .. import __version__
from ..errors import ConfigError, TfcompatError

SCHEMA = 1
_PROG = "tfcompat"


def _dist_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# ----------------------------------------------------------------------------- report
def _report(args):
    from .. import version
    from .._probe import backends as _backends
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
        doc["resolutions"] = [r.as_dict() for r in _backends.report()]
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
        print(f"tfcompat {doc['tfcompat']}  python {doc['python']}  torch {doc['torch']}  "
              f"transformers {doc['transformers']}  flash-attn {doc['flash_attn'] or '-'}")
        print(f"supported transformers: {doc['supported_range'][0]} .. {doc['supported_range'][1]} (newer: probed)")
        if doc.get("note"):
            print("note:", doc["note"])
        # one block per decision, at most 100 columns: capability and choice, then the reason wrapped
        import textwrap

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
    return 1 if doc["error"] or any(r["impl"] == "unsupported" for r in doc["resolutions"]) else 0


# ------------------------------------------------------------------------------ check
def _check(args):
    from .. import version
    from .._probe import resolve as _resolve
    from . import checks as _checks

    if args.device or args.plan or args.dtype:
        return _check_device(args)
    if args.config or args.model:
        return _check_model(args)
    try:
        version.require_supported_transformers("tfcompat check")
        installed = _resolve.installed_families()
        names = installed if not args.family else [_resolve._family(f).name for f in args.family]
    except Exception as exc:
        return _check_fail(args, f"{type(exc).__name__}: {exc}")
    missing = [n for n in names if n not in installed]
    if missing:
        return _check_fail(args, f"transformers {_dist_version('transformers')} does not ship "
                                 f"{', '.join(missing)}; installed families: {', '.join(installed)}")
    _quiet_transformers()
    results = []
    start = time.perf_counter()
    width = max(len(n) for n in names)
    for name in names:
        for result in _checks.run_family(name, tolerance=args.tolerance):
            results.append(result)
            if not args.json:
                print(_check_line(result, width), flush=True)
    failed = sum(not r["passed"] for r in results)
    skipped = sum(r["skipped"] is not None for r in results)
    doc = {"schema": SCHEMA, "tfcompat": __version__, "transformers": _dist_version("transformers"),
           "torch": _dist_version("torch"), "families": names, "results": results, "passed": failed == 0,
           "seconds": round(time.perf_counter() - start, 3)}
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        print(f"{len(results) - failed - skipped} passed, {failed} failed, {skipped} skipped ({len(names)} "
              f"{'family' if len(names) == 1 else 'families'}, transformers {doc['transformers']}, "
              f"{doc['seconds']:.1f}s)")
    return 0 if failed == 0 else 1


def _check_model(args):
    """``check --config PATH`` / ``--model PATH``: the user's model (scaled down, or with its weights)."""
    from .. import version
    from .._probe import resolve as _resolve
    from .._probe.drift import load_config
    from .._probe.families import family
    from . import checks as _checks
    from .scale import scaled_config

    path = args.model or args.config
    try:
        version.require_supported_transformers("tfcompat check")
        from .._probe.drift import compare, raw_of

        try:  # the family before transformers' own "does not recognize this architecture"
            named = raw_of(path).get("model_type")
        except (ConfigError, AttributeError):
            named = None  # load_config says what is wrong with the file
        if isinstance(named, str) and family(named).name not in _resolve.installed_families():
            fam = family(named)
            raise TfcompatError(f"transformers {_dist_version('transformers')} does not ship {fam.name} (first "
                                f"shipped in transformers {fam.since}); install transformers>={fam.since} to "
                                f"load this checkpoint")
        config = load_config(path)
        fam = family(config)
        if fam.name not in _resolve.installed_families():
            raise TfcompatError(f"transformers {_dist_version('transformers')} does not ship {fam.name} (first "
                                f"shipped in transformers {fam.since})")
        _quiet_transformers()

        drifted = compare(raw_of(path), config)
        if drifted:
            return _drift_exit(args, path, drifted)
        if args.model:
            import torch

            from ..testing import model_class

            model = model_class(fam.name).from_pretrained(path, torch_dtype=torch.float32, local_files_only=True)
            target, kept, how = {"model": model}, {}, f"{path}: its own weights (fp32)"
        else:
            scaled, kept = scaled_config(config)
            target, how = {"config": scaled}, f"{path}: scaled down"
    except Exception as exc:  # says why it cannot serve this model: exit 2, one line
        return _check_fail(args, f"{path}: {type(exc).__name__}: {exc}")
    start = time.perf_counter()
    results = list(_checks.run_family(fam.name, tolerance=args.tolerance, **target))
    if "config" in target and any(r["error"] for r in results):
        try:  # checks that raised: where upstream itself cannot run the config, say that (exit 2), not "N failed"
            _upstream_runs(fam.name, target["config"])
        except TfcompatError as exc:
            return _check_fail(args, f"{path}: {exc}")
    if not args.json:
        print(f"{fam.name} ({type(config).__name__}, transformers {_dist_version('transformers')}): {how}")
        for key, value in kept.items():
            print(f"  kept {key} = {value}")
        for result in results:
            print(_check_line(result, len(fam.name)), flush=True)
    failed = sum(not r["passed"] for r in results)
    skipped = sum(r["skipped"] is not None for r in results)
    doc = {"schema": SCHEMA, "tfcompat": __version__, "transformers": _dist_version("transformers"),
           "torch": _dist_version("torch"), "families": [fam.name], "source": path,
           "kept": {k: str(v) for k, v in kept.items()}, "results": results, "passed": failed == 0,
           "seconds": round(time.perf_counter() - start, 3)}
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        print(f"{len(results) - failed - skipped} passed, {failed} failed, {skipped} skipped ({path}, "
              f"transformers {doc['transformers']}, {doc['seconds']:.1f}s)")
    return 0 if failed == 0 else 1


def _drift_exit(args, path, drifted):
    """The file sets RoPE facts this release builds otherwise: every record, exit 2 (no check would be of the
    model the file describes)."""
    release = _dist_version("transformers")
    if args.json:
        print(json.dumps({"schema": SCHEMA, "tfcompat": __version__, "transformers": release, "source": path,
                          "passed": False, "drift": [dataclasses.asdict(d) for d in drifted]}, indent=2,
                         sort_keys=True, default=str))
    else:
        print(f"{path}: transformers {release} builds another RoPE than this file sets:")
        for d in drifted:
            print(f"  {d.line()}")
        print("  load it with the release that saved it, or set the facts under the keys this release reads "
              "(tfcompat.config.drift lists them)")
    return 2


def _check_device(args):
    """``check --device DEV [--dtype T] [--plan]``: the checks on the user's device (``_device_checks``)."""
    from .. import version
    from .._probe import resolve as _resolve
    from . import device_checks as _device_checks

    device = args.device or "cuda"
    dtype = args.dtype or ("fp32" if device == "cpu" else "bf16")
    if args.config or args.model:
        return _check_fail(args, "--device runs the families' tiny models; check --config/--model on the CPU")
    try:
        version.require_supported_transformers("tfcompat check")
        installed = _resolve.installed_families()
        names = installed if not args.family else [_resolve._family(f).name for f in args.family]
        kernels, checks, attention = _device_checks.plan(device, dtype)
    except Exception as exc:
        return _check_fail(args, f"{type(exc).__name__}: {exc}")
    if args.plan:
        print(f"tfcompat check --device {device} --dtype {dtype} would run, per family ({len(names)}): "
              f"{', '.join(checks)}; once: {attention}; then the RoPE speed lines. Kernels there:")
        for line in kernels:
            print(f"  {line}")
        return 0
    why = _device_checks.unavailable(device)
    if why:
        return _check_fail(args, why)
    _quiet_transformers()
    start = time.perf_counter()
    width = max(len(n) for n in names + ["(kernel)"])
    results = []
    for result in _device_checks.run(names, device, dtype, args.tolerance):
        results.append(result)
        if not args.json:
            print(_check_line(result, width), flush=True)
    speeds = _device_checks.speed(device, dtype, names)
    failed = sum(not r["passed"] for r in results)
    doc = {"schema": SCHEMA, "tfcompat": __version__, "transformers": _dist_version("transformers"),
           "torch": _dist_version("torch"), "device": device, "dtype": dtype, "families": names,
           "results": results, "speed_ms": dict(speeds), "passed": failed == 0,
           "seconds": round(time.perf_counter() - start, 3)}
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        for label, ms in speeds:
            print(f"  speed {label:<16} {ms:9.3f} ms  {ms / speeds[-1][1]:5.2f}x the copy")
        if not speeds:
            print("  speed: no checked family has a plain NeoX rotary to time")
        print(f"{len(results) - failed} passed, {failed} failed on {device} {dtype} ({len(names)} families, "
              f"{doc['seconds']:.1f}s)")
    return 0 if failed == 0 else 1


def _upstream_runs(name, config):
    """Raise a TfcompatError when the installed transformers itself cannot run ``config`` (built unpatched, one
    forward of a text row as the checks build it): there is no oracle to compare against, and the checks' raw
    errors would say nothing."""
    import torch

    from ..testing import tiny_sequence
    from .checks import _model

    try:
        model = _model(name, config)
        with torch.no_grad():
            ids = torch.tensor([tiny_sequence(name, text=5, config=model.config)])
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise TfcompatError(f"transformers {_dist_version('transformers')} itself cannot run this config "
                            f"({type(exc).__name__}: {first}); there is nothing to compare tfcompat against: fix "
                            f"the config (or run the release it was written for)") from None


def _check_line(result, width):
    head = f"  [{{}}] {result['family']:<{width}} {result['check']:<22} {result['compares']:<8}"
    if result["skipped"] is not None:
        return head.format("skip") + f" {result['skipped']}"
    mark = "ok  " if result["passed"] else "FAIL"
    return (head.format(mark) + f" max|diff| {result['max_abs_diff']:<10.3g} tol {result['tolerance']:<8.2g} "
            f"{result['seconds']:6.2f}s" + (f"  {result['error']}" if result["error"] else ""))


def _quiet_transformers():
    """transformers' own log lines (kernel fallbacks, deprecations) would interleave with the table."""
    try:
        from transformers.utils import logging
    except ImportError:
        return
    logging.set_verbosity_error()


def _check_fail(args, message):
    if args.json:
        print(json.dumps({"schema": SCHEMA, "passed": False, "error": message, "results": []}, indent=2))
    else:
        print(f"{_PROG} check: {message}", file=sys.stderr)
    return 2


# ------------------------------------------------------------------------------- main
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
