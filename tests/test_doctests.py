"""The examples in the public modules' docstrings run as written, on every release (tiny models, no download)."""

import doctest
import importlib

import pytest

MODULES = ["tfcompat.rope", "tfcompat.config", "tfcompat.packing", "tfcompat.varlen", "tfcompat.embeds"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.attempted > 0, f"{name} has no docstring example to run"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (printed above)"
