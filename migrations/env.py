"""Alembic environment: the database URL comes from jobsvc's settings, passed in by `jobsvc
migrate` (or read from JOBSVC_DATABASE_URL when alembic is run by hand)."""

from alembic import context

from jobsvc.settings import Settings
from jobsvc.store import make_engine
from jobsvc.store.tables import Base

config = context.config
database_url = config.attributes.get("database_url") or Settings.from_env().resolved_database_url

engine = make_engine(database_url)
with engine.begin() as connection:
    context.configure(connection=connection, target_metadata=Base.metadata,
                      render_as_batch=engine.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
