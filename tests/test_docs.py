"""The examples in the public docstrings run and say what they print."""

import doctest

import pytest

import tensorplace.budget
import tensorplace.planning


@pytest.mark.parametrize("module", [tensorplace.budget, tensorplace.planning])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_the_extension_stubs_name_what_the_extension_has():
    """python/tensorplace/_core.pyi declares every public name of the compiled core, and no other."""
    import ast
    import pathlib

    from tensorplace import _core

    stub = pathlib.Path(tensorplace.planning.__file__).with_name("_core.pyi")
    declared = set()
    for node in ast.parse(stub.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            declared.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            declared.add(node.target.id)
    public = {name for name in dir(_core) if not name.startswith("_")}
    assert public - declared == set(), "in the extension, not in its stubs"
    assert declared - public == set(), "in the stubs, not in the extension"
