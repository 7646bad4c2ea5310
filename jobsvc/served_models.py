"""The models a fleet serves, by the names jobs ask for: each worker's model under its served
name, and each LoRA adapter it loaded under the adapter's name.

A worker registers what it serves with every heartbeat, from its first (while its engine
starts, the routers already count it live): the model (task, weights, context length, the
engine's own once it is ready) in `jobsvc:models`, and the names it serves under its shard in
`jobsvc:shard-models`.
Both outlive the worker, so a model whose workers are all gone stays known: its jobs wait on the
shards that served it until a worker for it comes back (`jobsvc.departures` moves them then),
and are never given to another model's worker. A name no worker ever registered is refused at
submit. Until any worker has registered, the settings' own model stands in for the fleet's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from functools import lru_cache

import redis

from jobsvc.errors import InvalidJob, translated
from jobsvc.keys import MODELS_KEY, SHARD_MODELS_KEY
from jobsvc.prompts import PromptBuilder
from jobsvc.settings import Settings

GENERATE = "generate"
EMBED = "embed"
# How long a producer reuses the registry it read (as `routing.live.LIVE_SET_SECONDS`).
REGISTRY_SECONDS = 1.5


@dataclass(frozen=True)
class ServedModel:
    """One name jobs may ask for, and what a producer needs to prepare its jobs."""

    name: str
    # `generate` or `embed`: which requests the model answers.
    task: str
    # The weights the workers load (a folder or a hub name): the tokenizer comes from there.
    weights: str
    # Longest prompt plus answer its engines accept (0: the model config's).
    context: int
    # For a LoRA adapter, the served name of the model it adapts; None for a model.
    base: str | None = None

    def to_json(self) -> str:
        """The record kept in Redis."""
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> ServedModel:
        """A record read back from Redis."""
        return cls(**json.loads(raw))


def served_by(settings: Settings, context: int) -> list[ServedModel]:
    """What a worker of these settings serves, its engine running with `context` tokens: its
    model, then each of its adapters."""
    model = ServedModel(settings.served_model_name, settings.task, settings.model, context)
    return [model, *(ServedModel(name, settings.task, settings.model, context,
                                 base=settings.served_model_name)
                     for name in settings.lora_modules)]


def register(client: redis.Redis, shard: int, models: Iterable[ServedModel]) -> None:
    """Record that `shard` serves these models now (and no others), in one transaction."""
    models = list(models)
    with client.pipeline(transaction=True) as pipe:
        pipe.hset(MODELS_KEY, mapping={model.name: model.to_json() for model in models})
        pipe.hset(SHARD_MODELS_KEY, str(shard), json.dumps([model.name for model in models]))
        pipe.execute()


def read_registry(client: redis.Redis) -> tuple[dict[str, ServedModel], dict[int, list[str]]]:
    """Every model ever registered, by name, and the names each shard served last."""
    with client.pipeline(transaction=False) as pipe:
        pipe.hgetall(MODELS_KEY)
        pipe.hgetall(SHARD_MODELS_KEY)
        models, shards = pipe.execute()
    return ({_text(name): ServedModel.from_json(raw) for name, raw in models.items()},
            {int(shard): json.loads(names) for shard, names in shards.items()})


class FleetModels:
    """The registry as a producer uses it, read again at most every `REGISTRY_SECONDS`: which
    names may be asked for, and how to tokenize each one's prompts."""

    def __init__(self, client: redis.Redis, settings: Settings, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._redis = client
        self._own = ServedModel(settings.served_model_name, settings.task, settings.model,
                                settings.max_model_len)
        self._clock = clock
        self._models: dict[str, ServedModel] = {}
        self._read_at = float("-inf")

    def models(self) -> Mapping[str, ServedModel]:
        """Every name jobs may ask for now; the settings' own model while none registered."""
        now = self._clock()
        if now - self._read_at >= REGISTRY_SECONDS:
            with translated("read the models the fleet serves"):
                self._models = read_registry(self._redis)[0] or {self._own.name: self._own}
            self._read_at = now
        return self._models

    def described(self, name: str | None) -> ServedModel:
        """The model of that name as registered, for reading its jobs' answers; the settings'
        own model where it is not (None, or a name no longer registered)."""
        return self.models().get(name or self._own.name, self._own)

    def resolve(self, name: str | None, task: str) -> ServedModel:
        """The model a job names (None: the settings' served model), checked to answer
        `task`; InvalidJob naming `model` otherwise."""
        name = self._own.name if name is None else name
        model = self.models().get(name)
        if model is None:
            known = ", ".join(sorted(self.models())) or "none"
            raise InvalidJob(f"model {name!r} is not served by this fleet (it serves: "
                             f"{known})", "model")
        if model.task != task:
            raise InvalidJob(f"model {name!r} answers {model.task} requests, not {task} "
                             "requests", "model")
        return model

    @staticmethod
    def prompts(model: ServedModel) -> PromptBuilder:
        """The prompt builder of `model`'s tokenizer, made once per weights and context."""
        return _prompt_builder(model.weights, model.context)


@lru_cache(maxsize=64)
def _prompt_builder(weights: str, context: int) -> PromptBuilder:
    return PromptBuilder(weights, context)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
