"""The package layout resolves statically: a type checker finds every project module by its path.

text_generation_server is a PEP 420 namespace package with one portion per top-level folder
(server/, quantizers/, kernels/). These tests keep that true for the two ways people meet it:
the tree itself (`python -m mypy` from the root, with pyproject's [tool.mypy]) and the install
(a program outside the tree importing the package, resolved through what pip wrote into
site-packages, with no project configuration at all).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PORTIONS = {  # top-level folder -> the package folder it holds
    "server": REPO / "server" / "text_generation_server",
    "quantizers": REPO / "quantizers" / "text_generation_server" / "quantizers",
    "kernels": REPO / "kernels" / "text_generation_server" / "kernels",
}
IMPORT_ERRORS = re.compile(r"error: .*\[(import-not-found|import-untyped|import)\]")


def project_modules() -> list[str]:
    """Every importable module of the three portions, by dotted name."""
    names = set()
    for folder in PORTIONS.values():
        root = folder.parent if folder.name == "text_generation_server" else folder.parent.parent
        for path in folder.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            names.add(".".join(parts))
    return sorted(names)


def test_portions_are_packages_of_one_namespace():
    """No portion may claim the namespace (an __init__.py there would hide the other two)."""
    for top, folder in PORTIONS.items():
        namespace = REPO / top / "text_generation_server"
        assert namespace.is_dir(), f"{namespace} is missing"
        assert not (namespace / "__init__.py").exists(), f"{namespace}/__init__.py would shadow the other portions"
        assert sorted(p.name for p in (REPO / top).iterdir() if p.name != "__pycache__") == ["text_generation_server"], \
            f"{top}/ holds more than its portion: anything else there lands on sys.path as a top-level name"
        assert (folder / "py.typed").is_file(), f"{folder} lacks py.typed: checkers would skip it once installed"
        for sub in [folder, *(p for p in folder.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
            if any(sub.glob("*.py")) and sub != REPO / "server" / "text_generation_server":
                assert (sub / "__init__.py").is_file(), f"{sub} has modules but no __init__.py"


def test_every_module_imports_from_its_folder():
    """Python's namespace import joins the portions the way the paths say."""
    for name in ("text_generation_server.cli.main", "text_generation_server.quantizers.gptq",
                 "text_generation_server.kernels.table"):
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None
        top = {"quantizers": "quantizers", "kernels": "kernels"}.get(name.split(".")[1], "server")
        assert Path(spec.origin).resolve().is_relative_to(PORTIONS[top]), f"{name} comes from {spec.origin}"


def _mypy(args: list[str], cwd: Path) -> str:
    pytest.importorskip("mypy", reason="mypy comes with the test extra")
    done = subprocess.run([sys.executable, "-m", "mypy", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode in (0, 1), f"mypy failed to run:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_mypy_resolves_every_import_in_the_tree(tmp_path):
    """`python -m mypy` on the tree, as a developer runs it: no project import goes unresolved."""
    folders = ["server", "quantizers", "kernels", "tests", "integration-tests", "benchmarks", "proto", "scripts"]
    out = _mypy(["--cache-dir", str(tmp_path / "cache"), *folders], REPO)
    unresolved = [line for line in out.splitlines() if IMPORT_ERRORS.search(line)]
    assert not unresolved, "mypy cannot resolve:\n" + "\n".join(unresolved)
    assert "checked" in out.splitlines()[-1], out[-2000:]


def test_installed_package_resolves_without_project_config(tmp_path):
    """A program outside the tree sees every module through the install alone (a static .pth)."""
    user = tmp_path / "user.py"
    modules = project_modules()
    assert len(modules) > 60 and "text_generation_server.about" in modules
    user.write_text("".join(f"import {name}\n" for name in modules)
                    + "from text_generation_server.about import __version__\nreveal_type(__version__)\n")
    # Imports are checked for resolution only (following them all would analyse torch), except
    # about.py, which is read to show the module found is the project's own.
    (tmp_path / "mypy.ini").write_text("[mypy]\nfollow_imports = skip\n"
                                       "[mypy-text_generation_server.about]\nfollow_imports = normal\n")
    out = _mypy(["--config-file", str(tmp_path / "mypy.ini"), "--cache-dir", str(tmp_path / "cache"),
                 "--python-executable", sys.executable, str(user)], tmp_path)
    unresolved = [line for line in out.splitlines() if IMPORT_ERRORS.search(line)
                  and "text_generation_server" in line]
    assert not unresolved, "not resolvable from the install:\n" + "\n".join(unresolved[:20])
    assert re.search(r'Revealed type is "(builtins\.)?str"', out), out[-2000:]
