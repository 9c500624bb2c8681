"""A stale torch JIT-extension lock is refused in one line before a DeepSpeed world starts
(validate/engines/deepspeed_jit_lock.py); a lock whose folder a process is building in is left alone."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from validate.engines.deepspeed_jit_lock import check_extension_locks, extensions_root


def test_stale_lock_refused_live_build_not(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions_root() == tmp_path  # torch's rule: the variable is the root itself, no py*_cpu folder
    (tmp_path / "fused_adam").mkdir()
    check_extension_locks()  # no lock: nothing to say
    lock = tmp_path / "fused_adam" / "lock"
    lock.touch()
    with pytest.raises(ValueError, match="^" + re.escape(f"{lock}: a torch JIT-extension lock with no build running")) as err:
        check_extension_locks()
    assert "\n" not in str(err.value)
    # a build in progress: a process whose working directory is the op's build directory (as ninja's is)
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], cwd=lock.parent)
    try:
        check_extension_locks()
    finally:
        builder.kill()
        builder.wait()


def test_validate_deepspeed_refuses_a_stale_lock(tmp_path, monkeypatch):
    """``zeroplan validate --engine deepspeed``: exit 2, one line naming the file, no rank started."""
    pytest.importorskip("torch")
    from typer.testing import CliRunner

    from tests.clicheck import assert_one_line_error
    from zeroplan.cli import app

    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "lock").touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    result = CliRunner().invoke(app, ["validate", "--engine", "deepspeed", "--world-size", "2"])
    assert_one_line_error(result, f"{tmp_path / 'cpu_adam' / 'lock'}: a torch JIT-extension lock")
    assert os.path.exists(tmp_path / "cpu_adam" / "lock")  # reported, never deleted
