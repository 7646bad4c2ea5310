"""`jobsvc migrate`: bring a database to the newest schema with Alembic."""

from __future__ import annotations

from alembic import command
from alembic.config import Config

from jobsvc.settings import REPOSITORY_ROOT


def upgrade_to_head(database_url: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(REPOSITORY_ROOT / "migrations"))
    config.attributes["database_url"] = database_url
    command.upgrade(config, "head")
