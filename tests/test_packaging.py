"""The installed package: every module in the wheel, ``attnbias.kernels``, never a top-level
``kernels`` module.

Hugging Face's ``kernels`` package (which transformers imports) owns the top-level name
``kernels``; a fresh virtual environment with both installed must import both.
"""

from __future__ import annotations

import re
import site
import subprocess
import sys
import textwrap
import zipfile
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


def _modules() -> list[str]:
    """Every module of the source tree, by the name it installs as."""
    names = []
    for path in sorted((ROOT / "attnbias").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if "kernels" in parts:  # a link to kernels/ where a tree has one
            continue
        names.append(".".join(parts).removesuffix(".__init__"))
    for path in sorted((ROOT / "kernels").glob("*.py")):
        names.append("attnbias.kernels" + ("" if path.stem == "__init__" else f".{path.stem}"))
    return names


def test_the_wheel_holds_every_module_and_installs(tmp_path: Path) -> None:
    """The wheel built from the tree holds every module, ``py.typed`` and the licence; installed
    in a fresh environment, every module imports and ``attnbias.__version__`` is the
    metadata's."""
    # with this environment's setuptools where it is recent enough (no index needed)
    try:
        import setuptools

        isolation = (
            [] if int(setuptools.__version__.split(".")[0]) < 77 else ["--no-build-isolation"]
        )
    except ImportError:
        isolation = []
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation,
         "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(ROOT)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("attnbias-*.whl")
    files = set(zipfile.ZipFile(wheel).namelist())
    for name in _modules():
        path = name.replace(".", "/")
        assert f"{path}.py" in files or f"{path}/__init__.py" in files, name
    assert "attnbias/py.typed" in files
    assert any(f.endswith(".dist-info/licenses/LICENSE") for f in files), sorted(files)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    with zipfile.ZipFile(wheel) as archive:  # a wheel installs by unpacking it
        archive.extractall(purelib)
    # torch, triton and the rest come from this environment (after the fresh one's own)
    (Path(purelib) / "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    found = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert found is not None
    version = found.group(1)
    check = textwrap.dedent(
        f"""
        import importlib, os, sys
        sys.path = [p for p in sys.path if p not in ("", os.getcwd())]
        for name in {_modules()!r}:
            module = importlib.import_module(name)
            assert "site-packages" in module.__file__, module.__file__
        import attnbias
        assert attnbias.__version__ == {version!r}, attnbias.__version__
        print("ok")
        """
    )
    result = subprocess.run([python, "-c", check], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
