"""LoRA adapters in settings and engine arguments: JOBSVC_LORAS parsed and refused, the
engine's LoRA slots sized from the adapters' own configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobsvc.errors import ConfigurationError
from jobsvc.settings import Settings
from jobsvc.workers.engine import engine_args, is_cpu_build
from jobsvc.workers.lora import lora_slot_rank

pytestmark = pytest.mark.unit


def _adapter(folder: Path, rank: int, **config: object) -> str:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"], **config}))
    return str(folder)


def test_adapters_are_read_as_names_and_paths_in_the_order_given() -> None:
    settings = Settings.from_env({"JOBSVC_LORAS": " sql = /adapters/sql ,chat=/adapters/chat,"})
    assert list(settings.lora_modules.items()) == [("sql", "/adapters/sql"),
                                                    ("chat", "/adapters/chat")]
    assert Settings.from_env({}).lora_modules == {}


@pytest.mark.parametrize("loras", ["sql", "=/adapters/sql", "sql=", "sql=/a,sql=/b"])
def test_an_adapter_without_a_name_and_path_of_its_own_is_refused(loras: str) -> None:
    with pytest.raises(ConfigurationError, match="JOBSVC_LORAS"):
        Settings.from_env({"JOBSVC_LORAS": loras})


def test_an_adapter_may_not_take_the_served_models_name() -> None:
    with pytest.raises(ConfigurationError, match="'jobsvc' is the served model's own name"):
        Settings.from_env({"JOBSVC_LORAS": "jobsvc=/adapters/sql"})


def test_an_embedding_worker_serves_no_adapter() -> None:
    with pytest.raises(ConfigurationError, match="generating workers only"):
        Settings.from_env({"JOBSVC_TASK": "embed", "JOBSVC_LORAS": "sql=/adapters/sql"})


def test_without_adapters_the_engine_has_no_lora_slots() -> None:
    args = engine_args(Settings.from_env({}))
    assert not {"enable_lora", "max_loras", "max_lora_rank"} & set(args)


def test_the_engine_holds_every_adapter_at_the_largest_rank_vllm_accepts(
        tmp_path: Path) -> None:
    """On CPU one slot more, left empty: vLLM's CPU kernels read the base model's requests
    from the last slot."""
    loras = f"sql={_adapter(tmp_path / 'sql', 8)},chat={_adapter(tmp_path / 'chat', 12)}"
    args = engine_args(Settings.from_env({"JOBSVC_LORAS": loras}))
    slots = 3 if is_cpu_build() else 2
    assert (args["enable_lora"], args["max_loras"], args["max_lora_rank"]) == (True, slots, 16)


def test_a_module_of_a_larger_rank_sizes_the_slots(tmp_path: Path) -> None:
    loras = f"sql={_adapter(tmp_path / 'sql', 8, rank_pattern={'v_proj': 40})}"
    assert engine_args(Settings.from_env({"JOBSVC_LORAS": loras}))["max_lora_rank"] == 64


@pytest.mark.parametrize(("rank", "slot"), [(1, 1), (2, 8), (8, 8), (300, 320), (321, 512),
                                            (512, 512)])
def test_a_rank_rounds_up_to_a_slot_rank_of_vllms(rank: int, slot: int) -> None:
    assert lora_slot_rank(rank) == slot


def test_a_rank_above_vllms_largest_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="rank of 513"):
        lora_slot_rank(513)


@pytest.mark.parametrize("config", [None, "not json", {"lora_alpha": 16}, {"r": 0}])
def test_an_adapter_without_a_readable_config_is_refused_by_name(
        tmp_path: Path, config: object) -> None:
    folder = tmp_path / "sql"
    folder.mkdir()
    if config is not None:
        (folder / "adapter_config.json").write_text(
            config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(ConfigurationError, match="adapter 'sql'"):
        engine_args(Settings.from_env({"JOBSVC_LORAS": f"sql={folder}"}))
