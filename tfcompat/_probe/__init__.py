"""Patch time: everything that reads transformers. The family table, the version-probing resolvers and their
plans, the source probes, the sliding-window reading (``window``), the attention carrier (``carrier``), the tiny
configs the probes run, the environment report (``backends``: the kernel choice per device, read from the kernel
table), config drift (``drift``, ``derived``), and the 4.x shims (``transformers4``). The RoPE settings a config
describes are the RoPE feature's (:mod:`.._rope.settings`), on this floor.

Imported when a capability is first resolved or a model is patched; per-layer code never imports it (it reads
what ``patch`` bound from here).
"""
