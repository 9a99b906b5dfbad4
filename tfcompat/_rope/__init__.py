"""RoPE, one feature in one folder, its modules on the floors of their lifetime (tests/test_rooms.py's table):

* kernels: ``native`` (the CPU kernels and the composite, each with an analytic backward), ``fused`` (the fused
  Triton kernel) and ``fused_proof`` (its first-use proof), ``implementation`` (which implementation serves a call,
  the RoPE rows of the kernel table, and the ``Rotation`` that binds one kernel's call);
* patch time: ``settings`` (the RoPE settings a config describes on the installed release).

Its public face is :mod:`..rope` (``apply_rope``) and :mod:`..config` (``rope_parameters``); the resolver of
upstream's rotary function is the ``rope.apply`` capability of :mod:`.._probe.resolve`."""
