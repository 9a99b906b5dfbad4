"""tfcompat: GLM and Qwen vision-language training code that stays correct on every transformers release.

Importing this package is cheap and pure: it imports neither torch nor transformers and
patches nothing. Public modules: :mod:`.rope`, :mod:`.config`, :mod:`.errors`,
:mod:`.version`, :mod:`.testing`, :mod:`.packing`, :mod:`.varlen`, :mod:`.ulysses`, :mod:`.embeds`,
:mod:`.trainer`;
the record types :class:`Resolution` and :class:`PatchRecord` are importable from the package.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

__version__ = "0.3.0"

__all__ = ["__version__", "report", "clear_cache", "patch", "unpatch", "warmup", "enable_checkpointing",
           "disable_checkpointing", "Resolution", "PatchRecord"]

# value types of the records report() and patch() return, importable without importing torch:
# ``from tfcompat import Resolution, PatchRecord`` (resolved on first access)
_LAZY = {"Resolution": "_probe.resolve", "PatchRecord": "_step.patch"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def report(families: Optional[Iterable[str]] = None) -> list:
    """Every resolver decision for the installed transformers (see :class:`Resolution`)."""
    from ._probe import backends as _backends
    from ._probe import resolve as _resolve

    return _backends.environment() + _resolve.report(families)


def clear_cache() -> None:
    """Forget every cached resolution and every kernel's first-use proof (for tests)."""
    from ._kernels import table
    from ._probe import resolve as _resolve

    _resolve.clear_cache()
    table.forget()


def patch(model: Any, *, remove_padding: bool = True, ulysses_group: Any = None, dummy_visual: bool = True,
          slice_inputs: bool = False, context_group: Any = None) -> Any:
    """Patch a loaded GLM/Qwen model instance for packed sequences and Ulysses sequence parallelism.

    Args:
        model: a ForConditionalGeneration / ForCausalLM / bare Model of a supported family.
        remove_padding: accept packed rows (one row, several sequences). With False and no group,
            nothing is patched (the model stays bit-identical); with a group, each rank's row is
            one sequence.
        ulysses_group: a ``torch.distributed`` process group for sequence parallelism, or None.
        dummy_visual: vision-language models only: on a text-only batch in training mode, run the
            vision tower on the smallest valid input and add one zero-weighted scalar to the token
            embeddings, so every vision weight gets a zero (not None) gradient on every rank.
        slice_inputs: with ``ulysses_group`` or ``context_group``: every rank passes the whole packed row
            (ids, positions, pixels) to the model, which embeds it, keeps this rank's share (vision tokens,
            deepstack features and positions included) and returns this rank's share of the outputs
            (verl's VLM call). Without it, each rank passes its own share, and a whole row is refused.
        context_group: a ``torch.distributed`` process group for context parallelism: each rank holds two
            chunks of the packed row (chunk ``r`` and ``2c - 1 - r`` of ``2c``: equal causal work per rank;
            :func:`tfcompat.ulysses.slice_inputs` / ``slice_for_rank`` with ``context_group=`` cut them) and
            every attention layer gathers the whole row's keys and values. Any number of ranks, whatever
            the head count. Together with ``ulysses_group`` (a 2-D mesh: context x Ulysses), the Ulysses
            group splits each context rank's chunks; refused for linear-attention families.

    Returns:
        a :class:`PatchRecord` of what is patched now. Patching again with the same options
        changes nothing; other options, or a model partly unpatched, are re-patched. Patching a
        submodule of a patched model re-patches that part with the new options.

    Raises:
        ModelError: ``model`` is not a model instance (a config, a family name, a class).
        UnsupportedTransformersError: a family or release tfcompat does not serve (the reason is named).
        UlyssesError: a group the model's heads cannot be split over; ``slice_inputs`` without a group.

    The patched modules keep upstream's ``forward`` signature (HF Trainer's column filter and
    ``generate()`` read it); a call that is not packed runs upstream's own path.

    .. versionadded:: 0.1.0
    """
    from ._step import patch as _patch

    return _patch.patch(model, remove_padding=remove_padding, ulysses_group=ulysses_group, dummy_visual=dummy_visual,
                        slice_inputs=slice_inputs, context_group=context_group)


def unpatch(model: Any) -> bool:
    """Restore a model patched by :func:`patch`."""
    from ._step import patch as _patch

    return _patch.unpatch(model)


def warmup(model: Any, example: dict) -> list:
    """Prove tfcompat's GPU kernels for ``model`` before compiling it: one eager forward of ``example`` (the keyword
    arguments of one training call, e.g. a packed micro-batch from ``DataCollatorWithFlattening``), so every kernel
    the call reaches proves itself on first use (once per process, on a slice beside the exact path), outside any
    graph. A graph traced after it calls the proven kernels (flash-attn's varlen function, torch's
    ``varlen_attn``: ops registered through ``torch.library``); no proof can run inside a graph, and a graph traced
    before it runs the SDPA path (with a warning).

    Runs eagerly even where ``model`` or its layers are compiled (``torch.compiler.set_stance("force_eager")``),
    under ``no_grad`` (the proofs differentiate their own slices), and leaves the parameters' gradients untouched.
    Returns the proofs of this process (``op``, ``kernel``, ``device``, ``key``, ``ok``, ``max_abs_diff``, ...):
    a kernel with ``ok`` False failed its proof and the exact path serves it (``auto`` warned).

        >>> import torch, tfcompat
        >>> from tfcompat.testing import tiny_model
        >>> model = tiny_model("qwen2").train()  # the mode it will be compiled and trained in
        >>> _ = tfcompat.patch(model)
        >>> packed = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10]]),
        ...           "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])}
        >>> tfcompat.warmup(model, packed)  # on the CPU no GPU kernel runs: nothing to prove
        []
        >>> compiled = torch.compile(model)  # its graph calls the kernels proven above

    .. versionadded:: 0.2.0
    """
    import contextlib

    import torch

    from ._kernels import table
    from .errors import TfcompatError

    if not isinstance(example, dict):
        raise TfcompatError(f"tfcompat.warmup: example must be a dict of the model's forward keyword arguments "
                            f"(input_ids, position_ids or cu_seq_lens_q, ...), got {type(example).__name__}")
    eager = getattr(getattr(torch, "compiler", None), "set_stance", None)
    with (eager("force_eager") if eager is not None else contextlib.nullcontext()), torch.no_grad():
        getattr(model, "_orig_mod", model)(**example)
    return table.proven()


def enable_checkpointing(model: Any, *, reentrant: bool = False) -> str:
    """Switch transformers' own activation checkpointing on, on every release.

    transformers 5.24 renamed ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`` to
    ``activation_checkpointing_enable(activation_checkpointing_kwargs=...)`` (the old name warns and goes in
    v6). This calls whichever the model has, with ``use_reentrant=reentrant``, and returns its name.

        >>> import tfcompat
        >>> from tfcompat.testing import tiny_model
        >>> model = tiny_model("qwen2").train()
        >>> tfcompat.enable_checkpointing(model) in ("activation_checkpointing_enable", "gradient_checkpointing_enable")
        True
        >>> model.model.gradient_checkpointing
        True

    .. versionadded:: 0.1.0
    """
    from .errors import ModelError

    kwargs = {"use_reentrant": bool(reentrant)}
    if callable(getattr(model, "activation_checkpointing_enable", None)):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        return "activation_checkpointing_enable"
    if callable(getattr(model, "gradient_checkpointing_enable", None)):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return "gradient_checkpointing_enable"
    raise ModelError(f"tfcompat.enable_checkpointing: {type(model).__name__} has neither "
                     f"activation_checkpointing_enable nor gradient_checkpointing_enable; pass a transformers model")


def disable_checkpointing(model: Any) -> str:
    """Switch transformers' activation checkpointing off (either name); returns the method called.

    .. versionadded:: 0.1.0
    """
    from .errors import ModelError

    for name in ("activation_checkpointing_disable", "gradient_checkpointing_disable"):
        if callable(getattr(model, name, None)):
            getattr(model, name)()
            return name
    raise ModelError(f"tfcompat.disable_checkpointing: {type(model).__name__} is not a transformers model")
