"""Kernels: pure tensor code, imported by the step and the public modules, importing nothing of theirs. RoPE
(``rope``: CPU kernels and the composite; ``rope_triton``: the fused GPU kernel, ``rope_proof``: its first-use
proof), packed-row boundaries (``cu``), the calls into flash-attn and torch's varlen attention
(``attention_calls``), and the table of every kernel with its devices, dtypes and first-use proofs (``table``)."""
