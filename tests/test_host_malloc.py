"""The bench's host-memory regime (tensorplace.bench.common.host_malloc)."""

import json
import os
import subprocess
import sys

import pytest

from tensorplace.bench import parser
from tensorplace.bench.common import HOST_MALLOC_ENV, host_malloc


def test_an_unknown_host_malloc_mode_is_refused_with_the_choices() -> None:
    with pytest.raises(SystemExit, match="keep, default"):
        host_malloc("jemalloc")
    with pytest.raises(SystemExit):
        parser().parse_args(["models", "--host-malloc", "jemalloc"])


def test_default_leaves_the_heap_alone_and_every_subcommand_takes_the_option(monkeypatch) -> None:
    monkeypatch.delenv(HOST_MALLOC_ENV, raising=False)  # tests/conftest.py sets it
    assert host_malloc("default") == "default"
    for argv in (["models"], ["peers"], ["maxbatch", "--memory", "1GiB"], ["budgets"]):
        assert parser().parse_args(argv + ["--host-malloc", "default"]).host_malloc == "default"
        assert parser().parse_args(argv).host_malloc == "keep"


def test_keep_is_applied_and_recorded_in_the_json_header(tmp_path) -> None:
    # in a child process: mallopt changes the whole process's heap
    out = tmp_path / "models.json"
    code = ("import sys; from tensorplace.bench import main; "
            f"sys.exit(main(['models', '--json', {str(out)!r}]))")
    env = {k: v for k, v in os.environ.items() if k != HOST_MALLOC_ENV}  # the bench's own default
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=300, env=env)
    header = json.loads(out.read_text())
    want = "keep" if sys.platform.startswith("linux") else "default (not glibc)"
    assert header["host_malloc"] == want


def test_the_environment_sets_the_default(monkeypatch) -> None:
    monkeypatch.setenv(HOST_MALLOC_ENV, "default")
    assert parser().parse_args(["models"]).host_malloc == "default"
