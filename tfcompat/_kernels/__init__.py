"""Kernels: pure tensor code, imported by the step and the public modules, importing nothing of theirs. The kernel
table's row and the first-use proof machinery (``table``); RoPE (``rotation``: the RoPE rows, their choice and the
``Rotation`` that binds one kernel's call; ``rope``: CPU kernels and the composite; ``rope_triton``: the fused GPU
kernel, ``rope_proof``: its first-use proof); packed attention (``varlen_choice``: the rows of flash-attn's and
torch's varlen kernels, their calls and proof; ``attention_calls``: those calls' arguments; ``varlen``: the
dispatch, the SDPA path and the step's bound call; ``context``: context parallelism), the collectives
(``collectives``), packed-row boundaries (``cu``), and every op's choice for ``report`` (``choice``)."""
