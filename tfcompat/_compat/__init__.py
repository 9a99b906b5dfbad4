"""Shims named after the legacy they serve: each module holds what one range of transformers releases needs.

``transformers4``: 4.51-4.57 only. Dropping 4.x support = deleting that module, the ``tf45x`` tox
factors, and the call sites that name it (``grep -rn transformers4 tfcompat``: each one branch on a
probed fact, never on a version string).
"""
