"""Test helpers: the upstream oracle, read straight from the installed transformers."""

import contextlib
import copy
import functools
import importlib
import inspect
import os
import warnings

import pytest
import torch

from tfcompat._probe import resolve as _resolve
from tfcompat._probe.families import FAMILIES
from tfcompat.config import text_config
from tfcompat.testing import assert_close_to_model, tiny_config

# Tolerances from the dtype: fp32 results agree to a few ulp (FMA vs separate multiply-add).
# bf16: upstream rounds each product and the sum to bf16 (three roundings), native rounds once, so
# they differ by up to ~2 roundings (2**-8 relative each) of the largest *terms*, which can exceed
# the result when the terms cancel: terms reach |x| ~ 4 here, hence atol 2**-6 on top of rtol.
# fp16 likewise with 2**-11 per rounding: atol 2**-8.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2**-7, atol=2**-6),
       torch.float16: dict(rtol=2**-9, atol=2**-8)}

# torch.compile costs seconds per call (dynamo's warm-up): its tests run on the boundary releases of the matrix
# (tox.ini: the lowest torch and transformers, the last 4.x, the first 5.x, the newest), where what it traces moves
BOUNDARY_ONLY = pytest.mark.skipif(os.environ.get("TFCOMPAT_BOUNDARY_TESTS") == "skip",
                                   reason="torch.compile runs on the boundary releases of the matrix (tox.ini)")

# two parts of the boundary tests, each run on three of the four boundary environments (tox.ini says which), so that
# every plumbing edge still meets both: the tests over spawned gloo ranks (seconds to start each rank: not in tf50)
# and the compile tests (tests/test_compile.py, the docs' compiling examples; dynamo's warm-up: not in tf457, nor in
# tf525, whose release tf525-torch215 compiles with the newest torch)
SPAWNED_RANKS_SKIPPED = os.environ.get("TFCOMPAT_BOUNDARY_TESTS") == "skip" or \
    os.environ.get("TFCOMPAT_SPAWN_TESTS") == "skip"
SPAWNED_RANKS = pytest.mark.skipif(SPAWNED_RANKS_SKIPPED,
                                   reason="the tests over spawned ranks run on three boundary environments (tox.ini)")
COMPILES = pytest.mark.skipif(os.environ.get("TFCOMPAT_BOUNDARY_TESTS") == "skip" or
                              os.environ.get("TFCOMPAT_COMPILE_TESTS") == "skip",
                              reason="the compile tests run on three boundary environments (tox.ini)")

# what no release moves: the package's own structure read from its files, the command's plumbing (pipes, folders,
# refusals), vendored copies, an example made to fail. Once in the matrix (tox.ini: tf525, the newest release) and
# in every local run
ONCE = pytest.mark.skipif(os.environ.get("TFCOMPAT_ONCE_TESTS") == "skip",
                          reason="release-independent: runs once in the matrix (tox.ini: tf525)")

# what torch decides while the model code only carries it (stand-in kernels registered as ops inside compiled
# graphs): the lowest and the newest torch (tf451-torch27, tf525-torch215)
TORCH_DECIDES = pytest.mark.skipif(os.environ.get("TFCOMPAT_TORCH_TESTS") == "skip",
                                   reason="what torch decides: runs in the torch environments (tox.ini)")


def triton_ready():
    """Whether the Triton RoPE kernel can run on this process's CPU tensors (Triton's interpreter)."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def rope_impls():
    """apply_rope implementations that run on CPU tensors here (triton only in Triton's interpreter)."""
    return ["native", "composite"] + (["triton"] if triton_ready() else [])


def installed():
    return _resolve.installed_families()


def rotary_families():
    """Installed families whose text decoder has a rotary position embedding (NoPE ones refuse apply_rope: tested)."""
    return [n for n in installed() if not FAMILIES[n].nope]


def one_per_rope_kernel(names):
    """The first family of each shape a RoPE kernel sees: the resolved application plan (rotation, mRoPE
    layout) and the rotary facts of the tiny config (head and rotary widths, mRoPE sections). The Triton
    environments prove the kernel on these; the other implementations run on every family elsewhere."""
    from tfcompat.config import rope_parameters

    seen, out = set(), []
    for name in names:
        rp = rope_parameters(tiny_config(name))
        key = (_resolve.resolve("rope.apply", name).plan, rp.head_dim, rp.rotary_dim, rp.mrope_section,
               rp.mrope_interleaved)
        if key not in seen:
            seen.add(key)
            out.append(name)
    return out


def patchable():
    """Installed families tfcompat.patch serves (the rest refuse it with a reason: tested in test_patch)."""
    return [n for n in installed() if not FAMILIES[n].patch_refusal]


@functools.lru_cache(maxsize=None)
def plan_shape(name):
    """What a family-independent mechanism (checkpointing, optimizer steps, copies, RL layouts, clients) can
    depend on: the resolved attention and rotary plans (class names aside), the towers, MoE routing. Families
    of one shape run the same tfcompat code; the all-family packed == padded sweep (test_patch) and `tfcompat
    check` still cover every family's own numbers."""
    fam = FAMILIES[name]
    attention = _resolve.resolve("attention.signature", name).plan
    # MoE routing, read from the family's tiny settings (no config is built at collection time)
    moe = any("expert" in key and value for key, value in fam.tiny_text.items())
    return (fam.vision, fam.deepstack, bool(fam.tiny_top), moe, attention.params, attention.returns,
            attention.four_row_ids, bool(attention.linear_attention), _resolve.resolve("rope.apply", name).plan)


def one_per_shape(names):
    """The first family of each plan shape, in the table's order."""
    seen, out = set(), []
    for name in names:
        key = plan_shape(name)
        if key not in seen:
            seen.add(key)
            out.append(name)
    return out


def linear_attention(name):
    """Whether the family's text decoder has Gated DeltaNet (linear attention) layers on this release."""
    return bool(_resolve.resolve("attention.signature", name).plan.linear_attention)


def modeling(name):
    """The module defining the family's text attention and rotary (a composite's text family's)."""
    return importlib.import_module(FAMILIES[name].text_modeling)


def rotary(name, config=None):
    fam = FAMILIES[name]
    config = config if config is not None else tiny_config(name)
    return getattr(modeling(name), fam.rotary)(config=text_config(config)), config


def position_ids(name, batch, seq, generator):
    """Real 3-row mRoPE ids for VL families (T, H, W differ), plain 2-D ids otherwise."""
    if FAMILIES[name].vision:
        return torch.randint(0, 64, (3, batch, seq), generator=generator)
    return torch.randint(0, 64, (batch, seq), generator=generator)


_ROPE_CALLS: dict = {}


def _recorded_rope_call(name, config):
    """``(function, trailing args, trailing kwargs)`` of the first rotary call upstream's text attention makes: the
    installed model of ``config`` (``model_class``, eager attention) runs one 6-token text row with every function of
    the attention forward's own globals whose name says it applies a rotary embedding wrapped by a recorder."""
    from tfcompat.testing import model_class

    key = (name, config.to_json_string(use_diff=False))
    if key in _ROPE_CALLS:
        return _ROPE_CALLS[key]
    fam = FAMILIES[name]
    forward = inspect.unwrap(getattr(modeling(name), fam.attention).forward)
    space = forward.__globals__  # what the attention's own name lookups read
    names = [n for n, v in space.items() if callable(v) and n.startswith("apply_") and ("rotary" in n or "rope" in n)]
    calls = []

    def recorder(n, fn):
        def record(*args, **kwargs):
            calls.append((fn, args, kwargs))
            return fn(*args, **kwargs)
        return record

    saved = {n: space[n] for n in names}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_class(name)(copy.deepcopy(config)).eval()
    model.config._attn_implementation = "eager"
    for sub in model.modules():
        sub_config = getattr(sub, "config", None)
        if sub_config is not None and hasattr(sub_config, "_attn_implementation"):
            sub_config._attn_implementation = "eager"
    try:
        for n in names:
            space[n] = recorder(n, saved[n])
        with torch.no_grad():
            ids = torch.arange(10, 16)[None]
            if fam.vision:  # text positions on every mRoPE row: no rope-index pass (GLM-Image's asks for its grid)
                model(input_ids=ids, position_ids=torch.arange(6).expand(3, 1, 6))
            else:
                model(input_ids=ids)
    finally:
        space.update(saved)
    assert calls, f"upstream's {fam.attention} made no call to any of {names}"
    fn, args, kwargs = calls[0]
    # 5.25 wraps it as a kernel-hub module (``use_kernel_forward_from_hub``): its forward has the signature
    bound = inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn).bind(*args, **kwargs)
    bound.apply_defaults()
    _ROPE_CALLS[key] = fn, list(bound.arguments.items())
    return _ROPE_CALLS[key]


def upstream_rope(name, config):
    """The oracle: the rotary call upstream's attention really makes for ``config`` (recorded from the installed
    model's own forward, :func:`_recorded_rope_call`), replayed on the caller's tensors with every other argument
    that forward passed (the mRoPE section, ...); never a choice read from the source. A function that takes one
    tensor (``x, cos, sin``: GLM-5 on 5.3-5.5) is called for q and for k."""
    fn, recorded = _recorded_rope_call(name, config)
    names = [n for n, _ in recorded]
    tensors = names[:names.index("cos")]  # (q, k) or (x,)

    def call(q, k, c, s, unsqueeze_dim=1):
        def one(*xs):
            given = dict(recorded, **dict(zip(tensors, xs)), cos=c, sin=s)
            if "unsqueeze_dim" in given:
                given["unsqueeze_dim"] = unsqueeze_dim
            return fn(**given)
        return one(q, k) if len(tensors) == 2 else (one(q), one(k))

    return call


def param_grads(model):
    """{name: gradient} of every parameter that got one."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


close_to_model = assert_close_to_model  # the one whole-model tolerance, shared with `tfcompat check`


def grads_by_name(got, want, what):
    """Pair two {name: grad} dicts for comparison. A gradient present in one run only must be exactly zero:
    on releases that loop over experts, an expert that only padding tokens were routed to gets a zero
    gradient in the padded run and none in the packed one. Anything else missing is a failure."""
    pairs = []
    for key in sorted(set(got) | set(want)):
        if key in got and key in want:
            pairs.append((key, got[key], want[key]))
            continue
        present = got.get(key, want.get(key))
        assert not bool(present.count_nonzero()), f"{what}: nonzero gradient of {key} in one run only"
    assert pairs, f"{what}: no gradients to compare"
    return pairs


def verl_ulysses():
    """verl's own Ulysses helpers (``verl/utils/ulysses.py``, torch only), loaded from the installed verl's
    files without running its package ``__init__`` (which needs ray, tensordict, ...: verl is installed
    without its dependencies); None where verl is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "utils", "ulysses.py")
    module_spec = importlib.util.spec_from_file_location("_verl_utils_ulysses", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def calls_per_layer(build, call, skip=frozenset()):
    """tfcompat's own Python calls (and inspect's) per decoder layer of one forward: ``build(layers)`` gives a patched
    model, ``call`` its keyword arguments; counted with sys.setprofile over a forward at 2 and 6 layers (after a
    first forward that probes and imports), the difference / 4. ``skip``: (file, function name) pairs not counted
    (the Triton kernels' bodies, which Triton's interpreter runs as Python where a GPU runs them compiled)."""
    import sys

    import tfcompat

    package = os.path.dirname(tfcompat.__file__) + os.sep
    counts = []
    for layers in (2, 6):
        model = build(layers)
        with torch.no_grad():
            model(**call)  # first use: probes, imports, first-use proofs
        seen = {"tfcompat": 0, "inspect": 0}

        def profile(frame, event, arg, seen=seen):
            if event == "call":
                code = frame.f_code
                if code.co_filename.startswith(package) and (code.co_filename, code.co_name) not in skip:
                    seen["tfcompat"] += 1
                elif code.co_filename.endswith(os.sep + "inspect.py"):
                    seen["inspect"] += 1

        with torch.no_grad():
            sys.setprofile(profile)
            try:
                model(**call)
            finally:
                sys.setprofile(None)
        counts.append(seen)
    return {k: (counts[1][k] - counts[0][k]) / 4 for k in counts[0]}, counts


@contextlib.contextmanager
def said_if_not_served(impl):
    """``impl="triton"`` asked for a call the fused kernel cannot serve: tfcompat says so (a RuntimeWarning naming
    why) and the composite computes it. Recorded where a test provokes it; any other tfcompat warning fails."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    ours = [w for w in caught if str(w.message).startswith("tfcompat")]
    wrong = [str(w.message) for w in ours if impl != "triton" or "cannot serve this call" not in str(w.message)]
    assert not wrong, wrong
