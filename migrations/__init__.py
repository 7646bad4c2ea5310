"""jobsvc's Alembic migrations, a package so that they install with jobsvc and `jobsvc migrate`
finds them beside the installed code rather than in a checkout."""
