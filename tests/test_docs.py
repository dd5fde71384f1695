"""The examples in the public docstrings run and say what they print."""

import doctest

import pytest

import tensorplace.budget
import tensorplace.planning


@pytest.mark.parametrize("module", [tensorplace.budget, tensorplace.planning])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
