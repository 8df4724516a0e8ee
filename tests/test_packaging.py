"""The installed package: ``attnbias.kernels``, never a top-level ``kernels`` module.

Hugging Face's ``kernels`` package (which transformers imports) owns the top-level name
``kernels``; a fresh virtual environment with both installed must import both.
"""

from __future__ import annotations

import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.network
def test_installs_beside_hugging_face_kernels(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    # torch and triton come from this environment (appended after the fresh one's own)
    (Path(purelib) / "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    def pip(*args: str) -> None:
        result = subprocess.run(
            [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
            capture_output=True, text=True,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr

    pip("--no-deps", str(ROOT))  # a regular (non-editable) install: the wheel's real layout
    pip("kernels")
    check = textwrap.dedent(
        """
        import os, sys
        sys.path = [p for p in sys.path if p not in ("", os.getcwd())]
        import kernels, attnbias, attnbias.kernels
        from attnbias.kernels.limits import MAX_HEAD_DIM
        assert callable(kernels.get_kernel), kernels.__file__
        assert "attnbias" not in kernels.__file__, kernels.__file__
        ours = os.path.join("attnbias", "kernels", "__init__.py")
        assert attnbias.kernels.__file__.endswith(ours), attnbias.kernels.__file__
        assert "triton" not in sys.modules
        print("ok")
        """
    )
    result = subprocess.run([python, "-c", check], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
