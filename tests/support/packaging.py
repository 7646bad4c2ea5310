"""How the repository's folders are installed: what the wheel calls each package folder."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def installed_names(root: Path = ROOT) -> dict[str, str]:
    """Each of the repository's package folders with the import package the wheel installs it
    as (pyproject.toml's `package-dir`: the folder `workers` is `jobsvc.workers`)."""
    with (root / "pyproject.toml").open("rb") as file:
        package_dir = tomllib.load(file)["tool"]["setuptools"]["package-dir"]
    return {folder: package for package, folder in package_dir.items()}
