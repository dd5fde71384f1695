"""The README's example runs as written (in a temporary directory)."""

import re
from pathlib import Path


README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has a python example"
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    plan = scope["plan"]
    assert plan.predicted["peak_bytes"] <= plan.budget_bytes
    assert (tmp_path / "resnet18.plan.json").exists()
