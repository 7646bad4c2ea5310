"""Integration: jobsvc installs like a library. Its wheel holds the one import package
`jobsvc`, the workers, benchmark and migrations inside it; installed without the repository,
it migrates an empty PostgreSQL database from any working directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from alembic.script import ScriptDirectory

from jobsvc import migrations
from tests.support.environment import TEST_DATABASE, drop_database, empty_database
from tests.support.packaging import installed_names

pytestmark = pytest.mark.integration

REPOSITORY = Path(__file__).resolve().parents[2]
# What the wheel is built from, every folder pyproject.toml maps into `jobsvc` among them;
# the build writes its scratch folders beside these.
INSTALLED_AS = installed_names()
WHEEL_SOURCES = ("pyproject.toml", "README.md", *INSTALLED_AS)


@pytest.fixture()
def wheel_database() -> Iterator[str]:
    name = f"{TEST_DATABASE}_wheel"
    yield empty_database(name)
    drop_database(name)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def build_wheel(scratch: Path) -> Path:
    """Build the wheel from a copy of the sources (the build leaves folders in its source
    tree); returns the wheel."""
    source, wheels = scratch / "source", scratch / "wheels"
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
    (built,) = wheels.glob("jobsvc-*.whl")
    return built


def install_wheel(wheel: Path, folder: Path) -> dict[str, str]:
    """Install the wheel, without dependencies, into `folder`; returns an environment whose
    Python finds jobsvc there and its dependencies in this environment's site-packages
    (run it with -S: no site-packages of its own, so neither an editable install's path
    hook nor the repository is in reach)."""
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet",
                    "install", "--no-deps", "--target", str(folder), str(wheel)], check=True)
    dependencies = sysconfig.get_paths()["purelib"]
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith("JOBSVC_") and key != "PYTHONPATH"}
    return environment | {"PYTHONPATH": os.pathsep.join([str(folder), dependencies])}


def test_the_wheel_installs_the_jobsvc_package_alone_with_every_module(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {name.split("/")[0] for name in names} == {"jobsvc", "jobsvc-0.1.0.dist-info"}
    # pyproject.toml lists the packages one by one: a new subpackage must be added there.
    modules = {"/".join([*package.split("."), *path.relative_to(REPOSITORY / folder).parts])
               for folder, package in INSTALLED_AS.items()
               for path in (REPOSITORY / folder).rglob("*.py")}
    assert sorted(modules - names) == []


def test_the_installed_wheel_holds_the_workers_benchmark_and_migrations(
        tmp_path: Path, wheel: Path) -> None:
    environment = install_wheel(wheel, tmp_path)
    modules = ["jobsvc.workers.bootstrap", "jobsvc.bench.run", "jobsvc.demo", "jobsvc.simulate",
               "jobsvc.migrations"]
    where = subprocess.run(
        [sys.executable, "-S", "-c", "import importlib\n"
         f"for name in {modules!r}: print(importlib.import_module(name).__file__)"],
        cwd="/", env=environment, capture_output=True, text=True, check=True)
    files = [Path(line) for line in where.stdout.split()]
    assert len(files) == len(modules)
    assert all(file.is_relative_to(tmp_path / "jobsvc") for file in files)


def test_the_installed_wheel_migrates_an_empty_database_from_the_root_directory(
        tmp_path: Path, wheel: Path, wheel_database: str) -> None:
    environment = install_wheel(wheel, tmp_path) | {"JOBSVC_DATABASE_URL": wheel_database}
    subprocess.run([sys.executable, "-S", "-m", "jobsvc", "migrate"], cwd="/", env=environment,
                   check=True)

    head = ScriptDirectory(str(Path(migrations.__file__).parent)).get_current_head()
    with psycopg.connect(wheel_database) as connection:
        assert connection.execute("select version_num from alembic_version").fetchall() == [
            (head,)]
        assert connection.execute("select to_regclass('public.jobs')").fetchone() == ("jobs",)
