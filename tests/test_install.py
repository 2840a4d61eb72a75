"""Install and first contact: scripts/bootstrap.sh's torch reuse and Python check (dry-run mode, no downloads),
``--help`` of the launchers on a machine without the venv, pyproject.toml and its console entry points."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BOOTSTRAP = REPO / "scripts" / "bootstrap.sh"


def _bootstrap(env_extra: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("FLOWSPEC_VENV", "PYTHONPATH", "FLOWSPEC_TORCH",
                                                            "FLOWSPEC_TORCH_INDEX", "FLOWSPEC_REQUIREMENTS")}
    env.update(env_extra)
    return subprocess.run(["bash", str(BOOTSTRAP)], env=env, capture_output=True, text=True, timeout=timeout)


def _fake_torch(site: Path, version: str) -> None:
    """An importable ``torch`` package with installed-distribution metadata, as a real install leaves."""
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    info = site / f"torch-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")


def _pip_lines(err: str) -> list[str]:
    return [l for l in err.splitlines() if "would run:" in l and " pip install" in l]


def _base_python() -> str:
    """An interpreter without this venv's site-packages (a venv made from it sees no torch unless given one)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def test_bootstrap_reuses_preinstalled_torch_in_existing_venv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([_base_python(), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    site = next((venv / "lib").glob("python3*/site-packages"))
    _fake_torch(site, "2.7.0+cu126")
    r = _bootstrap({"FLOWSPEC_VENV": str(venv), "FLOWSPEC_BOOTSTRAP_DRY_RUN": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == str(venv / "bin" / "python")
    pips = _pip_lines(r.stderr)
    assert pips, r.stderr  # it did plan the requirements install ...
    assert not any(" torch" in l.split("pip install", 1)[1] for l in pips), r.stderr  # ... but never torch
    assert "torch held at 2.7.0+cu126" in r.stderr and "not reinstalled" in r.stderr
    assert not (venv / ".requirements.sha256").exists()  # dry run changes nothing


def test_bootstrap_new_venv_sees_base_torch(tmp_path):
    fake = tmp_path / "fake"
    _fake_torch(fake, "2.8.0")
    venv = tmp_path / "v"
    r = _bootstrap({"FLOWSPEC_VENV": str(venv), "FLOWSPEC_BOOTSTRAP_DRY_RUN": "1", "PYTHONPATH": str(fake),
                    "PYTHON": _base_python()})
    assert r.returncode == 0, r.stderr
    assert "-m venv --system-site-packages" in r.stderr
    assert not any(" torch" in l.split("pip install", 1)[1] for l in _pip_lines(r.stderr)), r.stderr
    assert "torch held at 2.8.0" in r.stderr and not venv.exists()


def test_bootstrap_installs_tested_torch_when_none_or_too_old(tmp_path):
    fake = tmp_path / "fake"
    _fake_torch(fake, "2.5.0a0+nv24.08")  # older than transformers 5's floor: not reused
    r = _bootstrap({"FLOWSPEC_VENV": str(tmp_path / "v"), "FLOWSPEC_BOOTSTRAP_DRY_RUN": "1",
                    "PYTHONPATH": str(fake), "PYTHON": _base_python()})
    if Path("/etc/nv_tegra_release").exists():
        assert r.returncode == 2 and "NVIDIA's torch" in r.stderr
        return
    assert r.returncode == 0, r.stderr
    assert "older than 2.6" in r.stderr and "--system-site-packages" not in r.stderr
    assert any("torch==2.13.0" in l for l in _pip_lines(r.stderr)), r.stderr


def test_bootstrap_rejects_old_python_in_one_line(tmp_path):
    py = tmp_path / "python3.9"
    py.write_text("#!/bin/sh\necho 3.9\n")
    py.chmod(0o755)
    r = _bootstrap({"FLOWSPEC_VENV": str(tmp_path / "v"), "PYTHON": str(py)})
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"[bootstrap] error: Python >= 3.10 is required, but '{py}' is Python 3.9 "
        "(set PYTHON=/path/to/python3.10 or newer)"]
    assert not (tmp_path / "v").exists()


@pytest.mark.parametrize("script,expect", [
    ("run_pipe.sh", "usage: ./run_pipe.sh"),
    ("run_eval.sh", "--datasets"),
    ("run_jetson.sh", "Multi-node launcher"),
])
def test_help_without_venv_does_not_bootstrap(tmp_path, script, expect):
    venv = tmp_path / "no_venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(FLOWSPEC_VENV=str(venv), PYTHON=_base_python())  # a python with neither torch nor the venv
    r = subprocess.run([str(REPO / script), "--help"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert expect in r.stdout and "[bootstrap]" not in r.stderr
    assert not venv.exists()
    if script == "run_jetson.sh":  # the help text only, none of the script after its comment header
        assert "set -euo" not in r.stdout and "ROOT=" not in r.stdout and "NODE_RANK=0" in r.stdout


def test_pyproject_and_entry_points():
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    proj = meta["project"]
    assert proj["requires-python"] == ">=3.10" and proj["license"] == "Apache-2.0"
    assert "Apache License" in (REPO / "LICENSE").read_text()[:200]
    reqs = [l.strip() for l in (REPO / "requirements.txt").read_text().splitlines()
            if l.strip() and not l.startswith("#")]
    for dep in ("torch>=2.6", "transformers>=5.20.2,<6"):  # one range in both places
        assert dep in proj["dependencies"] and dep in reqs
    scripts = proj["scripts"]
    assert {"flowspec-run", "flowspec-eval", "flowspec-bench", "flowspec-split", "flowspec-simulate",
            "flowspec-serve"} <= set(scripts)
    serve = proj["optional-dependencies"]["serve"]       # the server's own imports, declared (not via fschat)
    for dep in ("fastapi", "uvicorn", "prometheus_client"):
        assert any(d.startswith(dep) for d in serve) and any(r.startswith(dep) for r in reqs), dep
    for name, target in scripts.items():
        mod, func = target.split(":")
        assert callable(getattr(importlib.import_module(mod), func)), name
    packages = meta["tool"]["setuptools"]["packages"]
    for pkg in packages:
        assert (REPO / pkg.replace(".", "/") / "__init__.py").is_file(), pkg
    for target in scripts.values():  # every entry point lives in a shipped package or module
        mod = target.split(":")[0]
        assert mod.rsplit(".", 1)[0] in packages or mod in meta["tool"]["setuptools"]["py-modules"], target
