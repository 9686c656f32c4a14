"""``bench/ab_lockstep.py``'s A side imports the project from another checkout.

``bench/ab_tree/sitecustomize.py`` is what makes a lockstep A/B compare two releases: if the A
side quietly imported this checkout, every ratio would be 1 within noise. A checkout here is a
folder laid out as ``pyproject.toml``'s ``package-dir`` says; one made up in a temporary folder,
with a marker in each package, shows where each import came from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHOW = (
    "import json, mlpair, mlpair.prediction, mlpair.prediction.recording;"
    "print(json.dumps([mlpair.MARK, mlpair.prediction.MARK, mlpair.prediction.recording.MARK]))"
)


def imported(env: dict[str, str]) -> list[str]:
    done = subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_the_a_side_imports_the_project_from_the_other_checkout(tmp_path) -> None:
    with open(ROOT / "pyproject.toml", "rb") as f:
        folders = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    for name, folder in folders.items():
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / "__init__.py").write_text(f"MARK = 'other {name}'\n")
    (tmp_path / folders["mlpair.prediction"] / "recording").mkdir()
    (tmp_path / folders["mlpair.prediction"] / "recording" / "__init__.py").write_text("MARK = 'other recording'\n")
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "bench" / "ab_tree"),
        "MLPAIR_AB_TREE": str(tmp_path),
    }

    assert imported(env) == ["other mlpair", "other mlpair.prediction", "other recording"]

    env.pop("MLPAIR_AB_TREE")  # without it, this checkout's project as always
    done = subprocess.run(
        [sys.executable, "-c", "import mlpair.prediction.recording as c; print(c.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and Path(done.stdout.strip()).is_relative_to(ROOT), done.stderr[-2000:]
