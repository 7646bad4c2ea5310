"""Named errors of the public API; each message says what was wrong and what to do."""


class JobsvcError(Exception):
    """Base of every error jobsvc raises on purpose."""


class InvalidJob(JobsvcError, ValueError):
    """A job was refused at submit time; nothing was enqueued or recorded."""


class JobNotFound(JobsvcError, KeyError):
    """No job with this ID is recorded."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "job not found"


class ConfigurationError(JobsvcError):
    """A JOBSVC_* setting has a value jobsvc cannot use."""


class StorageUnavailable(JobsvcError):
    """The database could not record a submit; nothing was enqueued."""


class BrokerUnavailable(JobsvcError):
    """Redis could not take a submit's messages; nothing was kept."""
