"""Settings parsing and compression helpers."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobsvc import compression
from jobsvc.errors import ConfigurationError, InvalidJob
from jobsvc.prompts import PromptBuilder
from jobsvc.settings import EMBEDDED_DATABASE_URL, Settings
from jobsvc.validation import validate_job
from jobsvc.workers.engine import engine_args, sampling_params
from jobsvc.workloads import document_questions, lexicon

pytestmark = pytest.mark.unit


def test_settings_read_typed_values_from_the_environment() -> None:
    settings = Settings.from_env({"JOBSVC_SHARDS": "3", "JOBSVC_ENFORCE_EAGER": "no",
                                  "JOBSVC_GPU_MEMORY_UTILIZATION": "0.5"})
    assert (settings.shards, settings.enforce_eager, settings.gpu_memory_utilization) == (
        3, False, 0.5)
    assert Settings.from_env({}).resolved_database_url == EMBEDDED_DATABASE_URL


@pytest.mark.parametrize("environ", [{"JOBSVC_SHARDS": "two"}, {"JOBSVC_SHARDS": "0"},
                                     {"JOBSVC_ENFORCE_EAGER": "maybe"},
                                     {"JOBSVC_ZSTD_LEVEL": "40"}, {"JOBSVC_DTYPE": "fp8"},
                                     {"JOBSVC_ADMISSION_CHUNK": "-1"},
                                     {"JOBSVC_ADMISSION_PAUSE_MS": "-5"}])
def test_bad_settings_are_refused_with_the_variable_named(environ: dict[str, str]) -> None:
    with pytest.raises(ConfigurationError, match="JOBSVC_"):
        Settings.from_env(environ)


def test_compression_round_trips_and_marks_zstd_frames() -> None:
    data = ("the same sentence again " * 200).encode()
    frame = compression.compress(data)
    assert compression.is_zstd_frame(frame) and len(frame) < len(data) / 10
    assert compression.decompress(frame) == data


def test_generated_text_is_deterministic() -> None:
    assert lexicon()[:5] == lexicon()[:5]
    assert document_questions(2, 2, 50, seed=3) == document_questions(2, 2, 50, seed=3)


def test_the_tiny_model_runs_float32_unless_told_otherwise(tmp_path: Path) -> None:
    assert engine_args(Settings.from_env({}))["dtype"] == "float32"
    assert engine_args(Settings.from_env({"JOBSVC_DTYPE": "bfloat16"}))["dtype"] == "bfloat16"
    assert engine_args(Settings.from_env({"JOBSVC_MODEL": str(tmp_path)}))["dtype"] == "auto"


def test_a_priority_reaches_the_engine_only_where_it_schedules_by_priority() -> None:
    job = {"document": "doc", "question": "q", "priority": -5, "logit_bias": {7: 2.5}}
    fcfs = Settings.from_env({})
    assert engine_args(fcfs)["scheduling_policy"] == "fcfs"
    with pytest.raises(InvalidJob) as refused:
        validate_job(job, fcfs.job_limits)
    assert refused.value.field == "priority"
    by_priority = Settings.from_env({"JOBSVC_SCHEDULING_POLICY": "priority"})
    assert engine_args(by_priority)["scheduling_policy"] == "priority"
    sampling = validate_job(job, by_priority.job_limits).sampling
    assert (sampling["priority"], sampling["logit_bias"]) == (-5, {"7": 2.5})
    # The priority goes with the request, not in vLLM's sampling; the bias by token ID.
    params = sampling_params(sampling)
    assert not hasattr(params, "priority") and params.logit_bias == {7: 2.5}
    with pytest.raises(ConfigurationError, match="JOBSVC_SCHEDULING_POLICY"):
        Settings.from_env({"JOBSVC_SCHEDULING_POLICY": "lottery"})


def test_a_missing_default_model_is_refused_naming_the_setting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed jobsvc away from a checkout has no tiny model at the default path."""
    absent = tmp_path / "ops" / "tiny-llama"
    monkeypatch.setattr("jobsvc.prompts.TINY_MODEL", absent)
    with pytest.raises(ConfigurationError, match="set JOBSVC_MODEL"):
        PromptBuilder(str(absent))
