"""The environment as ``report`` lists it beside the per-family resolutions: the kernel table, the packed-attention
kernel and the RoPE implementation per device (decided in ``_rope.implementation`` and ``_attention.kernel_choice``,
re-exported here), the versions.

Imports: the records (``plans.Resolution``), the version reader and the kernels below it.
"""

from .. import version as _version
from .._attention.kernel_choice import (
    flash_varlen,
    torch_varlen_params,
    torch_varlen_signature,
    varlen_kernel,
    varlen_unfit,
)

# the kernel choice and what it reads, re-exported: report, the checks and the tests read them here
from .._kernels.choice import rows, select, unavailable  # noqa: F401
from .._kernels.table import installed, torch_ships  # noqa: F401
from .._rope.implementation import impl_for, triton_kernels  # noqa: F401
from .plans import Resolution

__all__ = ["installed", "torch_ships", "torch_varlen_signature", "torch_varlen_params", "varlen_unfit", "varlen_kernel",
           "unavailable", "select", "flash_varlen", "triton_kernels", "impl_for", "environment"]


def _kernel_table():
    from .._kernels import table

    parts = []
    for op in ("rope", "varlen"):
        for row in rows(op):
            why = unavailable(op, row.name)
            where = ",".join(row.devices) or "explicit only"
            parts.append(f"{op}.{row.name} [{where}{' ' + '/'.join(row.dtypes) if row.dtypes else ''}, priority "
                         f"{row.priority}{', proves itself on first use' if row.gpu else ''}]"
                         + (f" unavailable: {why}" if why else ""))
    done = table.proven()
    proofs = "; ".join(f"{p['op']}.{p['kernel']} on {p['device']} {p['key']}: "
                       f"{'ok' if p['ok'] else 'FAILED ' + (p['error'] or 'max |diff| %.3g' % p['max_abs_diff'])} "
                       f"({p['seconds'] * 1e3:.1f} ms)" for p in done)
    return Resolution(
        "kernels.table", f"{len(done)} proven" if done else "none proven yet", "",
        "kernel table: " + "; ".join(parts) + ". First-use proofs in this process: " + (proofs or "none yet"),
        str(_version.transformers_version()))


def _varlen_backends():
    cuda = varlen_kernel(False)
    unused = "; ".join(f"not {k}: {v}" for k, v in varlen_unfit().items() if v)
    return Resolution("varlen.backend", cuda, "", f"packed attention: CUDA fp16/bf16 tensors -> {cuda}; "
                               f"CPU, fp32 or dropout -> sdpa (exact fallback, one fused SDPA call per sequence)"
                               + (f"; {unused}" if unused else "") + "; the GPU kernels get equal cu_seqlens_q/k "
                               "only (context-parallel pieces run SDPA: bottom-right causal alignment for cu_q != "
                               "cu_k is checked by bench/gpu_check.py on a GPU)",
                               str(_version.transformers_version()))


def _rope_impls():
    cuda = impl_for("cuda")
    why = "triton imports" if cuda == "triton" else "triton does not import"
    return Resolution(
        "rope.impl", f"cpu={impl_for('cpu')} cuda={cuda}", "",
        f"apply_rope impl='auto': CPU tensors -> {impl_for('cpu')} (sliced in-cache kernels); CUDA tensors -> "
        f"{cuda} ({why}); under torch.compile or with cos/sin requiring grad -> composite",
        str(_version.transformers_version()))


def environment():
    """The environment's decisions (RoPE implementations, packed-attention kernels, the kernel table), as records:
    :func:`tfcompat.report` lists them before every family resolution."""
    return [_rope_impls(), _varlen_backends(), _kernel_table()]
