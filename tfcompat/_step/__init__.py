"""Step time: ``patch`` installs the forwards here; a packed step's boundaries are found once (``boundaries``,
``shards``), carried down on the rotary module's output (``install``, ``scope``), and every layer reads only its
arguments, the step and what patch time bound (``forwards``; the attention's ``attend``: upstream's forward with
tfcompat's call through ``AttentionInterface`` where the release routes it, else the bundled forward, which
prepares the step's rotation once per layout); the text model's step (``text``, ``traced``), the top model and
vision owner (``top``), the towers' dummy forwards (``dummy``), the placeholder tokens (``tokens``) and the mRoPE
positions (``rope_index``).
"""
