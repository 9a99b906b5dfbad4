"""``tfcompat check``: the checks of :mod:`.checks` per family, on a user's config or checkpoint
(``--config``/``--model``, after the config-drift comparison), or on a device (``--device``/``--dtype``/``--plan``,
:mod:`.device_checks`); lines or one JSON document (schema 1), exit 0 passed, 1 failed, 2 cannot serve."""

import contextlib
import dataclasses
import json
import sys
import time

from .. import __version__
from ..errors import ConfigError, TfcompatError
from .common import _PROG, SCHEMA, _dist_version


def check(args):
    """``tfcompat check``; with ``--json`` the document is the only thing on stdout: whatever the work prints
    there (DeepSpeed's import-time log line, when transformers imports it while loading a model) goes to stderr."""
    if not args.json:
        return _check(args)
    args.out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        return _check(args)


def _print_json(args, doc, **kw):
    print(json.dumps(doc, **kw), file=getattr(args, "out", None) or sys.stdout)


def _check(args):
    from .. import version
    from .._probe import resolve as _resolve
    from . import checks as _checks

    if (args.ulysses or args.context) and not args.config:
        return _check_fail(args, "--ulysses/--context run a user's model scaled down: give --config PATH")
    if any(n is not None and n < 1 for n in (args.ulysses, args.context)):
        return _check_fail(args, "--ulysses and --context take a degree of at least 1")
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
    began = time.perf_counter()
    from ..testing import model_class

    for name in names:  # torch, transformers and the families' modeling modules: timed apart from the checks
        model_class(name)
    imports = time.perf_counter() - began
    results = []
    start = time.perf_counter()
    width = max(len(n) for n in names)
    for name in names:
        for result in _checks.run_family(name, tolerance=args.tolerance):
            results.append(result)
    label = f"{len(names)} {'family' if len(names) == 1 else 'families'}"
    if not args.json:
        print(f"tfcompat check: tfcompat vs transformers {_dist_version('transformers')}'s own code, tiny "
              f"random-weight models, {label}, cpu")
        print(f"time: imports {imports:.1f}s (torch, transformers, the modeling modules), checks "
              f"{time.perf_counter() - start:.1f}s")
        for line in summary_lines(results):
            print(line)
        if args.verbose:
            print("every check:")
        for result in results:
            if args.verbose or (not result["passed"] and result["skipped"] is None):
                print(_check_line(result, width))
    return _finish(args, results, start, {"families": names, "import_seconds": round(imports, 3)}, label)


#: what a line of the table means (printed with the summary)
LEGEND = ("legend: [ok  ] within tol of upstream; [FAIL] outside it, or raised (the line says what); [skip] does "
          "not apply, the reason given. fwd compares the outputs, fwd+bwd the outputs and every gradient; max|diff| "
          "is the largest absolute difference from the installed transformers' own code. One line per check: "
          "--verbose.")


def summary_lines(results):
    """The summary block: what passed (each check, over how many families), what was skipped, grouped by why
    (which families, which checks), what failed (each), and the legend; at most 100 columns."""
    import textwrap

    def wrap(head, text):
        return textwrap.wrap(text, 100, initial_indent=f"  {head:<9}", subsequent_indent=" " * 11,
                             break_on_hyphens=False, break_long_words=False)

    failed = [r for r in results if not r["passed"] and r["skipped"] is None]
    skipped = [r for r in results if r["skipped"] is not None]
    passed = [r for r in results if r["passed"] and r["skipped"] is None]
    lines = [f"summary: {len(passed)} passed, {len(failed)} failed, {len(skipped)} skipped"]
    per_check = {}
    for r in passed:
        per_check.setdefault(r["check"], set()).add(r["family"])
    lines += wrap("passed", ", ".join(f"{c} ({len(f)})" for c, f in per_check.items()) or "none")
    why = {}
    for r in skipped:
        fams, checks = why.setdefault(r["skipped"], ({}, {}))
        fams[r["family"]] = checks[r["check"]] = None
    for n, (reason, (fams, checks)) in enumerate(why.items()):
        count = sum(r["skipped"] == reason for r in skipped)
        lines += wrap("skipped" if n == 0 else "", f"{count} x {reason} [{', '.join(fams)}: {', '.join(checks)}]")
    lines += wrap("failed", ", ".join(f"{r['family']} {r['check']}" for r in failed) or "none")
    lines += textwrap.wrap(LEGEND, 100, subsequent_indent="  ", break_on_hyphens=False)
    return lines


def _check_model(args):
    """``check --config PATH`` / ``--model PATH``: the user's model (scaled down, or with its weights)."""
    from . import checks as _checks

    path = args.model or args.config
    began = time.perf_counter()
    try:
        loaded = _load_model(args, path)
    except Exception as exc:  # says why it cannot serve this model: exit 2, one line
        return _check_fail(args, f"{path}: {type(exc).__name__}: {exc}")
    if isinstance(loaded, int):
        return loaded  # the file's RoPE settings drift on this release: said, exit 2
    fam, config, target, kept, changed, how = loaded
    from . import layout_check

    allowed = layout_check.layouts(fam, config)
    ulysses, context = args.ulysses or 1, args.context or 1
    if ulysses * context > 1:
        why = layout_check.refusal(allowed, ulysses)
        if why:
            return _check_fail(args, f"{path}: not Ulysses {ulysses} x context {context}: {why}")
        why = layout_check.rank_limit(ulysses, context, layout_check.machine())
        if why:
            return _check_fail(args, f"{path}: {why}; the real heads allow this layout ({allowed['line']})")
    start = time.perf_counter()
    loading = start - began  # imports (transformers, the family's modules), reading and scaling: not the checks
    results = list(_checks.run_family(fam.name, tolerance=args.tolerance, **target))
    if ulysses * context > 1:
        results.append(layout_check.run(fam.name, target["config"], ulysses, context, args.tolerance))
    if "config" in target and any(r["error"] for r in results):
        try:  # checks that raised: where upstream itself cannot run the config, say that (exit 2), not "N failed"
            _upstream_runs(fam.name, target["config"])
        except TfcompatError as exc:
            return _check_fail(args, f"{path}: {exc}")
    if not args.json:
        print(f"{fam.name} ({type(config).__name__}, transformers {_dist_version('transformers')}): {how} "
              f"(imports and loading {loading:.1f}s)")
        for key, value in kept.items():
            print(f"  kept {key} = {value}")
        for key, (theirs, ours, why) in changed.items():
            print(f"  changed {key} {theirs} -> {ours} ({why})")
        print(f"  layouts: {allowed['line']}")
        for result in results:
            print(_check_line(result, len(fam.name)), flush=True)
    fields = {"families": [fam.name], "source": path, "layouts": allowed, "load_seconds": round(loading, 3),
              "kept": {k: str(v) for k, v in kept.items()},
              "changed": {k: {"from": str(a), "to": str(b), "why": why} for k, (a, b, why) in changed.items()}}
    return _finish(args, results, start, fields, path)


def _load_model(args, path):
    """(family, config, what to check, settings kept, settings changed, how) for ``--config``/``--model``; an exit
    status where the file's RoPE settings drift on this release. Raises where the file cannot be served."""
    from .. import version
    from .._probe import resolve as _resolve
    from .._probe.drift import compare, load_config, loadable, raw_of
    from .._probe.families import family
    from .scale import scaled_config

    version.require_supported_transformers("tfcompat check")
    try:  # the family before transformers' own "does not recognize this architecture"
        raw = raw_of(path)
    except ConfigError:
        raw = None  # load_config says what is wrong with the file
    _quiet_transformers()  # its log lines on the file's keys: the drift comparison below says what they mean
    config = loadable(path, raw) if isinstance(raw, dict) else load_config(path)
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
        return fam, config, {"model": model}, {}, {}, f"{path}: its own weights (fp32)"
    from ..testing import model_class

    model_class(fam.name)  # the modeling modules imported here, not inside the first check's time
    scaled, kept, changed = scaled_config(config, ulysses=getattr(args, "ulysses", None) or 1)
    return fam, config, {"config": scaled}, kept, changed, f"{path}: scaled down"


def _finish(args, results, start, fields, label):
    """The closing line (or the JSON document) of a check run, and its exit status."""
    failed = sum(not r["passed"] for r in results)
    skipped = sum(r["skipped"] is not None for r in results)
    doc = {"schema": SCHEMA, "tfcompat": __version__, "transformers": _dist_version("transformers"),
           "torch": _dist_version("torch"), **fields, "results": results, "passed": failed == 0,
           "seconds": round(time.perf_counter() - start, 3)}
    if args.json:
        _print_json(args, doc, indent=2, sort_keys=True)
    else:
        print(f"{len(results) - failed - skipped} passed, {failed} failed, {skipped} skipped ({label}, "
              f"transformers {doc['transformers']}, {doc['seconds']:.1f}s)")
    return 0 if failed == 0 else 1


def _drift_exit(args, path, drifted):
    """The file sets RoPE facts this release builds otherwise: every record, exit 2 (no check would be of the
    model the file describes)."""
    release = _dist_version("transformers")
    if args.json:
        _print_json(args, {"schema": SCHEMA, "tfcompat": __version__, "transformers": release, "source": path,
                           "passed": False, "drift": [dataclasses.asdict(d) for d in drifted]}, indent=2,
                    sort_keys=True, default=str)
    else:
        print(f"{path}: transformers {release} builds another RoPE than this file sets:")
        for d in drifted:
            print(f"  {d.line()}")
        print("  load it with the release that saved it, or set the facts under the keys this release reads "
              "(tfcompat.config.drift lists them)")
    return 2


def _check_device(args):
    """``check --device DEV [--dtype T] [--plan]``: the checks on the user's device (:mod:`.device_checks`)."""
    from .. import version
    from .._probe import resolve as _resolve
    from . import device_checks as _device_checks

    device = args.device or "cuda"
    refused = _device_checks.refusal(device)
    if refused:
        return _check_fail(args, refused)
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
        _print_json(args, doc, indent=2, sort_keys=True)
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
        _print_json(args, {"schema": SCHEMA, "passed": False, "error": message, "results": []}, indent=2)
    else:
        print(f"{_PROG} check: {message}", file=sys.stderr)
    return 2
