"""The README's figure is the demo's figure, drawn by the current view code.

Every PNG the view saves carries the hash of its drawing modules and the panels it drew
(``save_figure``). The README image must carry the current hash (else: regenerate it with
``python docs/make_readme_figure.py``), and the demo must write its figure through the same
code, with the same panels.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest

from cockpit.demo import run_demo
from cockpit.view.cockpit_view import (
    CODE_KEY,
    DRAWING_MODULES,
    PANELS_KEY,
    drawing_code_hash,
    plot_cockpit,
    read_png_text,
    save_figure,
)

ROOT = Path(__file__).resolve().parents[2]
README_IMAGE = ROOT / "docs" / "cockpit_view_demo.png"


@pytest.fixture(scope="module")
def demo_png(tmp_path_factory) -> dict[str, str]:
    logdir = tmp_path_factory.mktemp("demo") / "run"
    assert run_demo(["--steps", "3", "--logdir", str(logdir)]) == 0
    return read_png_text(logdir / "cockpit_view.png")


def test_readme_shows_the_image() -> None:
    assert "](docs/cockpit_view_demo.png)" in (ROOT / "README.md").read_text()


def test_readme_image_was_drawn_by_the_current_view_code() -> None:
    stored = read_png_text(README_IMAGE)
    assert stored.get(CODE_KEY) == drawing_code_hash(), (
        "docs/cockpit_view_demo.png was drawn by other view code than the current one: "
        "run `python docs/make_readme_figure.py`")


def test_readme_image_shows_the_current_demos_run(tmp_path) -> None:
    """The README's figure is the output of the demo as it trains today: its first steps'
    losses (stored in the PNG) are those of a fresh demo run (seeded: the same on every
    run, up to the rounding of the machine's float sums; the first steps of the default run
    are those of a short one)."""
    import json

    from cockpit.store import read_output
    from cockpit.view.cockpit_view import RUN_KEY, RUN_KEY_STEPS

    stored = read_png_text(README_IMAGE).get(RUN_KEY)
    assert stored is not None, "regenerate it with `python docs/make_readme_figure.py`"
    logdir = tmp_path / "demo"
    assert run_demo(["--steps", str(RUN_KEY_STEPS), "--no-plot", "--logdir", str(logdir)]) == 0
    output = read_output(logdir)
    # (to a millionth: the processor's vector width changes the last digits of the float
    # sums, and the training carries them on; another demo would differ in the first ones)
    assert json.loads(stored) == pytest.approx([output[s]["Loss"] for s in sorted(output)],
                                               rel=1e-6, abs=0)


def test_demo_figure_comes_from_the_same_code_and_panels(demo_png) -> None:
    readme = read_png_text(README_IMAGE)
    assert demo_png[CODE_KEY] == drawing_code_hash()
    assert demo_png[PANELS_KEY] == readme[PANELS_KEY]
    assert set(readme[PANELS_KEY].split(",")) >= {"Alpha", "GradHist1d", "Layers", "Findings",
                                                   "Loss"}


def test_provenance_changes_with_the_drawing_code(tmp_path) -> None:
    path = save_figure(plot_cockpit({0: {"Loss": 1.0}}, diagnosis=False), tmp_path / "v.png")
    text = read_png_text(path)
    assert text[CODE_KEY] == drawing_code_hash() and text[PANELS_KEY] == "Loss"
    copy = tmp_path / "view"
    copy.mkdir()
    package = ROOT / "src" / "cockpit" / "view"
    for name in DRAWING_MODULES:
        (copy / name).write_bytes((package / name).read_bytes())
    assert drawing_code_hash(copy) == text[CODE_KEY]
    with (copy / "instruments.py").open("ab") as f:
        f.write(b"# an edit\n")
    assert drawing_code_hash(copy) != text[CODE_KEY]


def test_make_readme_figure_copies_the_demo_figure(tmp_path, monkeypatch) -> None:
    """The script runs ``cockpit.demo.run_demo`` into a run directory and copies the figure
    it wrote there byte for byte (a stand-in demo writes a small run here)."""
    from cockpit.store import RunLogWriter
    from cockpit.view import plot_run

    spec = importlib.util.spec_from_file_location("make_readme_figure",
                                                  ROOT / "docs" / "make_readme_figure.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "TARGET", tmp_path / "readme.png")
    written = {}

    def stand_in_demo(argv):
        logdir = Path(argv[argv.index("--logdir") + 1])
        writer = RunLogWriter(logdir)
        for step in range(3):
            writer.write_step(step, {"Loss": 1.0 / (step + 1), "GradNorm": 0.5})
        writer.close()
        plot_run(logdir, logdir / "cockpit_view.png")
        written["png"] = (logdir / "cockpit_view.png").read_bytes()
        return 0

    import cockpit.demo

    monkeypatch.setattr(cockpit.demo, "run_demo", stand_in_demo)
    assert script.main([]) == 0
    assert (tmp_path / "readme.png").read_bytes() == written["png"]
    assert read_png_text(tmp_path / "readme.png")[CODE_KEY] == drawing_code_hash()


def test_make_readme_figure_redraws_a_kept_demo_run(tmp_path, monkeypatch) -> None:
    from cockpit.store import RunLogWriter

    spec = importlib.util.spec_from_file_location("make_readme_figure_redraw",
                                                  ROOT / "docs" / "make_readme_figure.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "TARGET", tmp_path / "readme.png")
    writer = RunLogWriter(tmp_path / "kept")
    writer.write_step(0, {"Loss": 2.0, "LearningRate": 0.1})
    writer.close()
    assert script.main(["--redraw", str(tmp_path / "kept")]) == 0
    made = (tmp_path / "readme.png").read_bytes()
    assert made == (tmp_path / "kept" / "cockpit_view.png").read_bytes()
    assert read_png_text(tmp_path / "readme.png")[PANELS_KEY] == "Loss,Findings"
