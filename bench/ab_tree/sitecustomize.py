"""Imports ``mlpair`` from another checkout: the A side of ``bench/ab_lockstep.py``.

Python imports ``sitecustomize`` at start-up from the first folder on ``sys.path`` that holds
one; ``bench/ab_lockstep.py`` puts this folder on ``PYTHONPATH`` of the A side's processes (its
worker, and the ``mlpair relay`` that worker starts) with ``MLPAIR_AB_TREE`` naming the other
checkout. The project's packages then come from that checkout, laid out as its own
``pyproject.toml`` says (``[tool.setuptools] package-dir``), ahead of the editable install of this
one; everything else (the virtual environment's libraries) is shared. A checkout of a release
that had C parts must have them built in place (``setup.py build_ext --inplace``).
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import tomllib
from pathlib import Path


class _OtherCheckout(importlib.abc.MetaPathFinder):
    def __init__(self, root: Path) -> None:
        with open(root / "pyproject.toml", "rb") as f:
            folders = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
        self.packages = {name: root / folder for name, folder in folders.items()}

    def find_spec(self, fullname, path, target=None):
        folder = self.packages.get(fullname)
        if folder is None:  # a subpackage or module: found through its parent's __path__
            return None
        if not (folder / "__init__.py").exists():  # a namespace package (mlpair, from the layout by portions)
            spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = [str(folder)]
            return spec
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


if os.environ.get("MLPAIR_AB_TREE"):
    sys.meta_path.insert(0, _OtherCheckout(Path(os.environ["MLPAIR_AB_TREE"]).resolve()))
