"""Integration: jobsvc installs like a library. Its wheel, installed without the repository,
migrates an empty PostgreSQL database from any working directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from alembic.script import ScriptDirectory

import migrations
from tests.conftest import TEST_DATABASE, drop_database, empty_database

pytestmark = pytest.mark.integration

REPOSITORY = Path(__file__).resolve().parent.parent
# What the wheel is built from; the build writes its scratch folders beside these.
WHEEL_SOURCES = ("pyproject.toml", "README.md", "jobsvc", "workers", "migrations")


@pytest.fixture()
def wheel_database() -> Iterator[str]:
    name = f"{TEST_DATABASE}_wheel"
    yield empty_database(name)
    drop_database(name)


def build_and_install_wheel(scratch: Path) -> Path:
    """Build the wheel from a copy of the sources (the build leaves folders in its source
    tree) and install it, without dependencies, into a folder of its own; returns that."""
    source, wheels, installed = scratch / "source", scratch / "wheels", scratch / "installed"
    source.mkdir()
    for name in WHEEL_SOURCES:
        if (REPOSITORY / name).is_dir():
            shutil.copytree(REPOSITORY / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPOSITORY / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(source)], check=True)
    (wheel,) = wheels.glob("jobsvc-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(installed), str(wheel)],
                   check=True)
    return installed


def test_the_installed_wheel_migrates_an_empty_database_from_the_root_directory(
        tmp_path: Path, wheel_database: str) -> None:
    installed = build_and_install_wheel(tmp_path)
    # -S: no site-packages of its own, so neither an editable install's path hook nor the
    # repository is in reach; the dependencies come from this environment's site-packages.
    dependencies = sysconfig.get_paths()["purelib"]
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith("JOBSVC_") and key != "PYTHONPATH"}
    environment |= {"PYTHONPATH": os.pathsep.join([str(installed), dependencies]),
                    "JOBSVC_DATABASE_URL": wheel_database}
    where = subprocess.run(
        [sys.executable, "-S", "-c", "import jobsvc, migrations; "
         "print(jobsvc.__file__); print(migrations.__file__)"],
        cwd="/", env=environment, capture_output=True, text=True, check=True)
    assert all(Path(line).is_relative_to(installed) for line in where.stdout.split())

    subprocess.run([sys.executable, "-S", "-m", "jobsvc", "migrate"], cwd="/", env=environment,
                   check=True)

    head = ScriptDirectory(str(Path(migrations.__file__).parent)).get_current_head()
    with psycopg.connect(wheel_database) as connection:
        assert connection.execute("select version_num from alembic_version").fetchall() == [
            (head,)]
        assert connection.execute("select to_regclass('public.jobs')").fetchone() == ("jobs",)
