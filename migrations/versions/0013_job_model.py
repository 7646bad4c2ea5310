"""Record the model each job asks for: a fleet serves several models (and LoRA adapters), and
a job runs only on a worker that serves its model.

Jobs recorded before this revision were all for the one model the fleet served then: they
take `JOBSVC_SERVED_MODEL_NAME` as it is set where the migration runs.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

from jobsvc.settings import Settings

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add `jobs.model`, the served model's name on jobs already recorded."""
    served = Settings.from_env().served_model_name
    with op.batch_alter_table("jobs") as jobs:
        jobs.add_column(sa.Column("model", sa.String(200), nullable=False,
                                  server_default=served))
    with op.batch_alter_table("jobs") as jobs:
        jobs.alter_column("model", server_default=None)


def downgrade() -> None:
    """Drop `jobs.model`."""
    with op.batch_alter_table("jobs") as jobs:
        jobs.drop_column("model")
