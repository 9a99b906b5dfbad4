"""Step time: ``patch`` installs the forwards here (``install``: what a patched module carries; ``forwards``: the
rotary, decoder-layer and linear-mixer forwards); the text model decides a packed step once (``text``), the top
model and the vision owner hand it down (``top``), ``scope`` carries what no argument reaches, the towers run their
dummy forwards (``dummy``), the placeholder tokens (``tokens``), the loss labels of a packed row (``labels``) and
the mRoPE positions (``rope_index``). The attention call itself and the step's boundaries are the attention
feature's (:mod:`.._attention`), the shards the parallel feature's (:mod:`.._parallel`).
"""
