"""Tools: the ``tfcompat`` command (``report``, ``check``, ``vendor``), the checks behind it, and config scaling.
Nothing outside this folder imports it, so a vendored copy may leave it out (``tfcompat vendor --no-tools``).
"""
