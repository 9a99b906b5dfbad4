"""Packed attention, one feature in one folder, its modules on the floors of their lifetime (tests/test_rooms.py's
table):

* kernels: ``cu`` (a packed row's boundaries as the kernels take them), ``gpu_calls`` (the calls into flash-attn
  and torch's varlen kernels, their signatures as data), ``kernel_choice`` (which packed-attention kernel serves a
  call: the varlen rows of the kernel table and their proofs), ``kernels`` (the dispatch every packed attention
  call takes, the SDPA path, the step's bound call);
* step time: ``starts`` (where a sequence starts in a row of positions, eagerly and traced side by side),
  ``boundaries`` (a step's boundaries found once, eagerly) and its traced twin ``traced`` (under torch.compile),
  ``attend`` (the attention call through transformers' ``AttentionInterface``, and the call both routes share),
  ``bundled`` (tfcompat's own attention forward, where upstream's does not serve a packed step).

Its public face is :mod:`..varlen` (``varlen_attention``) and :mod:`..packing`."""
