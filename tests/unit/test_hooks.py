"""A worker's hooks: none unless a setting names a factory, and a wrong name stops the worker
with the setting named."""

from __future__ import annotations

import pytest

from jobsvc.errors import ConfigurationError
from jobsvc.workers.hooks import WorkerHooks, load_hooks

pytestmark = pytest.mark.unit


class Custom(WorkerHooks):
    """Hooks of a deployment's own, as a setting names them."""


def not_hooks() -> object:
    return object()


NOT_A_FACTORY = "a string"


def test_no_setting_means_hooks_that_do_nothing() -> None:
    hooks = load_hooks("")
    assert type(hooks) is WorkerHooks
    hooks.on_claim(["a"])
    hooks.on_admit(1, 0.0)
    hooks.on_message_end(1, 0.0)
    hooks.on_stop()


def test_a_setting_names_the_factory_of_the_hooks() -> None:
    assert isinstance(load_hooks(f"{__name__}:Custom"), Custom)


@pytest.mark.parametrize(("path", "complaint"), [
    ("tests.test_hooks", "not of the form module:factory"),
    (":Custom", "not of the form module:factory"),
    ("tests.no_such_module:attach", "cannot import tests.no_such_module"),
    (f"{__name__}:missing", "has no callable missing"),
    (f"{__name__}:NOT_A_FACTORY", "has no callable NOT_A_FACTORY"),
    (f"{__name__}:not_hooks", "made a object, not WorkerHooks"),
])
def test_a_wrong_setting_is_refused_with_the_variable_named(path: str, complaint: str) -> None:
    with pytest.raises(ConfigurationError, match="JOBSVC_WORKER_HOOKS") as refused:
        load_hooks(path)
    assert complaint in str(refused.value)
