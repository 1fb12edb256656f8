"""What the package promises as an installed library: each optional part that misses its
package says in one line which extra installs it; the version comes from the package
metadata; ``python -m cockpit`` is the ``cockpit`` command; the type hints are shipped."""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

import cockpit
from cockpit._extras import DISTRIBUTION

ROOT = Path(__file__).parents[1]


def _pyproject() -> dict:
    if sys.version_info < (3, 11):
        pytest.skip("reading pyproject.toml needs tomllib (Python 3.11+)")
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _import(name: str):
    return lambda: importlib.import_module(name)


def _tensorboard_sink(tmp_path):
    from cockpit.store import TensorBoardSink

    return TensorBoardSink(tmp_path / "tb")


def _wandb_sink(tmp_path):
    from cockpit.store import WandbSink

    return WandbSink(project="x")


def _parquet(tmp_path):
    from cockpit.store import RunLogWriter
    from cockpit.store.export import export_run

    with RunLogWriter(tmp_path / "run") as writer:
        writer.write_step(0, {"Loss": 1.0})
    export_run(tmp_path / "run", tmp_path / "out.parquet", "parquet")


def _ray(tmp_path):
    from cockpit.benchmark.executors import RayExecutor

    RayExecutor()


def _sweep(tmp_path):
    from cockpit.benchmark.sweep import sweep

    sweep(["digits_logreg"], ["sgd"], output=str(tmp_path / "sweep"), progress=False)


def _demo(tmp_path):
    from cockpit.benchmark.problems.digits import load_digits_tensors

    load_digits_tensors()


# (what is used, the packages it needs, the modules re-imported, the message's start, extra)
OPTIONAL = [
    (lambda tmp_path: _import("cockpit.integrations.lightning")(), ["lightning"],
     ["cockpit.integrations.lightning"], "cockpit.integrations.lightning needs lightning",
     "lightning"),
    (lambda tmp_path: _import("cockpit.integrations.transformers")(), ["transformers"],
     ["cockpit.integrations.transformers"], "cockpit.integrations.transformers needs "
     "transformers", "transformers"),
    (_tensorboard_sink, ["tensorboard"], ["torch.utils.tensorboard"],
     "TensorBoardSink needs tensorboard", "tensorboard"),
    (_wandb_sink, ["wandb"], [], "WandbSink needs wandb", "wandb"),
    (_parquet, ["pyarrow"], [], "Parquet export needs pyarrow", "parquet"),
    (_ray, ["ray"], [], "--executor ray needs ray", "ray"),
    (_sweep, ["optuna"], [], "cockpit bench sweep needs optuna", "bench"),
    (_demo, ["sklearn"], [], "the digits data (scikit-learn's) needs sklearn", "demo"),
]


@pytest.mark.parametrize(("use", "packages", "modules", "message", "extra"), OPTIONAL,
                         ids=[case[-1] for case in OPTIONAL])
def test_a_missing_optional_package_names_its_extra(tmp_path, monkeypatch, use, packages,
                                                    modules, message, extra):
    for package in packages:  # as if it were not installed
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setitem(sys.modules, package, None)
    for name in modules:
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ImportError) as caught:
        use(tmp_path)
    error = caught.value
    assert str(error) == f"{message}, which is not installed: pip install '{DISTRIBUTION}[{extra}]'"
    assert error.__cause__ is None and error.__suppress_context__  # one line, no chain
    assert extra in _pyproject()["project"]["optional-dependencies"]


def test_a_broken_dependency_of_an_optional_package_is_not_hidden(monkeypatch):
    """Installed but broken inside (one of its own imports fails): its own error, since
    installing the extra would not help."""
    from cockpit._extras import missing_extra

    inner = ModuleNotFoundError("No module named 'fsspec'", name="fsspec")
    assert missing_extra(inner, "lightning", "lightning", "x") is inner
    outer = ModuleNotFoundError("No module named 'lightning'", name="lightning")
    assert "torch-cockpit[lightning]" in str(missing_extra(outer, "lightning", "lightning", "x"))


def test_every_install_hint_names_this_distribution():
    """No message or document tells users to install under another distribution's name."""
    project = _pyproject()["project"]
    assert project["name"] == DISTRIBUTION
    stale = []
    for path in [*ROOT.joinpath("src").rglob("*.py"), ROOT / "README.md",
                 *ROOT.joinpath("examples").rglob("*.py")]:
        for line in path.read_text().splitlines():
            if (("cockpit[" in line and f"{DISTRIBUTION}[" not in line)
                    or ("install cockpit" in line and "for-pytorch" not in line)):
                stale.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert not stale, stale


def test_version_comes_from_the_package_metadata():
    try:
        installed = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        assert cockpit.__version__ == "0+unknown"
    else:
        assert cockpit.__version__ == installed


def test_python_dash_m_cockpit_is_the_cockpit_command():
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    version = subprocess.run([sys.executable, "-m", "cockpit", "--version"], env=env,
                             capture_output=True, text=True, timeout=120)
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"cockpit {cockpit.__version__}"
    usage = subprocess.run([sys.executable, "-m", "cockpit"], env=env, capture_output=True,
                           text=True, timeout=120)
    assert usage.returncode == 2 and usage.stderr.startswith("usage: cockpit COMMAND")


def test_type_hints_are_shipped():
    assert (ROOT / "src" / "cockpit" / "py.typed").exists()
    data = _pyproject()["tool"]["setuptools"]
    assert "py.typed" in data["package-data"]["cockpit"]
