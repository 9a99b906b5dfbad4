"""Step time: ``patch`` installs the forwards here; a packed step's boundaries are found once (``boundaries``,
``shards``), carried down on the rotary module's output (``install``), and every layer reads only its
arguments, the step and what patch time bound (``forwards``; the rotation prepared once per step:
``rotation``; context parallelism: ``context``).
"""
