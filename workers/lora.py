"""LoRA adapters as the engine must be sized for them before any loads: each adapter's rank,
read from its PEFT configuration, and the slot rank vLLM accepts that holds it."""

from __future__ import annotations

import json
from pathlib import Path

from jobsvc.errors import ConfigurationError

# The ranks vLLM sizes its LoRA slots for (its `MaxLoRARanks`).
LORA_SLOT_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank(name: str, path: str) -> int:
    """An adapter's largest rank, as its PEFT config gives it (`r`, or a larger one some of
    its modules have): the engine's slots must be sized for it before the adapter loads."""
    config_path = Path(path) / "adapter_config.json"
    try:
        config = json.loads(config_path.read_text())
        ranks = [config["r"], *(config.get("rank_pattern") or {}).values()]
        if not all(isinstance(rank, int) and rank > 0 for rank in ranks):
            raise ValueError(f"ranks {ranks} are not all positive integers")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ConfigurationError(f"JOBSVC_LORAS: adapter {name!r}: {config_path} is not a "
                                 f"LoRA adapter's config ({type(error).__name__}: {error})"
                                 ) from None
    return max(ranks)


def lora_slot_rank(rank: int) -> int:
    """The smallest slot rank vLLM accepts that holds an adapter of `rank`."""
    for slot in LORA_SLOT_RANKS:
        if slot >= rank:
            return slot
    raise ConfigurationError(f"JOBSVC_LORAS: a LoRA rank of {rank} is above the "
                             f"{LORA_SLOT_RANKS[-1]} vLLM serves")
