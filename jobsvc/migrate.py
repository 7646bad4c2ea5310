"""`jobsvc migrate`: bring a database to the newest schema with Alembic."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from jobsvc import migrations


def upgrade_to_head(database_url: str) -> None:
    """Bring the database at `database_url` to the newest schema, with the shipped migrations."""
    config = Config()
    # The installed `jobsvc.migrations` package, so a wheel migrates from any working directory.
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    config.attributes["database_url"] = database_url
    command.upgrade(config, "head")
