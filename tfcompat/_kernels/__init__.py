"""The kernel table, shared by every op: the row each RoPE implementation and packed-attention kernel is, with the
first-use proof machinery (``table``), and every op's choice for ``report`` (``choice``). The kernels themselves live
with their feature (:mod:`.._rope`, :mod:`.._attention`, :mod:`.._parallel`), on the kernel floor."""
