"""Patch time: everything that reads transformers. The family table, the version-probing resolvers and their
plans, the source probes, the RoPE settings a config describes (``rope_params``), the sliding-window reading, the
tiny configs the probes run, the environment report (``backends``: the kernel choice per device, re-exported from
the kernels), config drift, and the 4.x shims (``transformers4``).

Imported when a capability is first resolved or a model is patched; per-layer code never imports it (it reads
what ``patch`` bound from here).
"""
