"""One typed settings object, read once from `JOBSVC_*` environment variables and passed down."""

from __future__ import annotations

import base64
import binascii
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from jobsvc.errors import ConfigurationError
from jobsvc.health import ALIVE_SECONDS
from jobsvc.routing.job_cost import DEFAULT_DECODE_COST
from jobsvc.routing.policies import DEFAULT_EPSILON, DEFAULT_WEIGHT, POLICY_NAMES
from jobsvc.validation import JobLimits

# The tiny test model, the default JOBSVC_MODEL, lives in a checkout of the repository, not in
# the installed package: an installed jobsvc elsewhere needs JOBSVC_MODEL (see `prompts`).
TINY_MODEL = Path(__file__).resolve().parent.parent / "ops" / "tiny-llama"
EMBEDDED_DATABASE_URL = "sqlite:///jobsvc.db"
DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULING_POLICIES = ("fcfs", "priority")
# What a worker's engine may do: answer prompts, or embed them as a pooling model.
TASKS = ("generate", "embed")


@dataclass(frozen=True)
class Settings:
    """Every setting has a default that serves a single machine; see the README for each."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    # Empty means the embedded SQLite store in the working directory (one-machine demo only).
    database_url: str = ""
    shards: int = 1
    model: str = str(TINY_MODEL)
    # Random weights for the tiny test model; "auto" loads a real checkpoint.
    load_format: str = "dummy"
    # Weights and activations. Empty: float32 for the tiny model, else "auto" (vLLM's choice,
    # which serves float32 checkpoints as bfloat16 on every x86 CPU, also on those without
    # native bfloat16 arithmetic, where the tiny model then runs much slower).
    dtype: str = ""
    # 0 means the model config's context length.
    max_model_len: int = 0
    # KV block size used by both the engine and the prefix hash; they must agree.
    block_size: int = 128
    # Most jobs per queue message. A worker claims, admits and acknowledges a message as one,
    # so fewer, larger messages cost fewer claims, writes and threads while the engine runs.
    batch_size: int = 256
    # Shard choice: cache_aware (cache overlap against load), affinity (a document sticks to
    # its first shard) or round_robin (docs/architecture.md compares them).
    routing: str = "cache_aware"
    # cache_aware: prefill tokens one unit of a shard's outstanding work is worth, and the
    # slack over the mean outstanding work beyond which a shard takes no job.
    routing_load_weight: float = DEFAULT_WEIGHT
    routing_load_slack: float = DEFAULT_EPSILON
    # Every policy (and `jobsvc simulate`): prefill tokens one output token (of a job's
    # max_tokens) adds to its shard's load.
    routing_decode_cost: float = DEFAULT_DECODE_COST
    # Messages a worker runs at once: enough that the engine's queue never runs dry
    # while a message finishes and the next is claimed.
    worker_concurrency: int = 8
    # A message's requests enter the engine this many at a time, one chunk every pause (0: all
    # at once, which the engine schedules best; pacing is for engines that stall on a burst).
    admission_chunk: int = 0
    admission_pause_ms: float = 15.0
    # CPU priority (nice, 0-19) of workers and the engine processes they start. The engine
    # busy-waits between steps, so on a host with few cores the database and the broker may
    # wait for one; a positive value puts them first, at a cost to the engine that was within
    # the noise, so the default leaves the priority alone (docs/operations.md).
    worker_nice: int = 0
    zstd_level: int = 3
    max_document_chars: int = 2_000_000
    max_question_chars: int = 20_000
    # Longest stop string a job may give (it may give 16).
    max_stop_chars: int = 1_000
    # Largest job record a worker reads (question and sampling, JSON-encoded), in bytes.
    max_job_bytes: int = 1 << 20
    gpu_memory_utilization: float = 0.9
    # KV cache size in GiB on CPU hosts (VLLM_CPU_KVCACHE_SPACE, unless that is set).
    cpu_kvcache_gb: int = 1
    enforce_eager: bool = True
    # How the engine orders the requests it holds: "fcfs" (arrival) or "priority" (a job's
    # `priority`, lower first, then arrival). Under fcfs a job giving a priority is refused.
    scheduling_policy: str = "fcfs"
    # Instruments a worker attaches (`jobsvc.workers.hooks`): `module:factory`, imported when the
    # worker starts. Empty: none. `jobsvc bench` names its probes for the workers it starts.
    worker_hooks: str = ""
    # Seconds before a crashed worker's unacknowledged messages are delivered again. Live
    # workers renew the lease on what they run, so long jobs are never delivered twice.
    visibility_timeout: int = 30
    # Deliveries before a job that keeps stopping its worker is given up as failed.
    max_attempts: int = 3
    # Seconds between a worker's reconciliation rounds: jobs whose queue message is gone
    # (a restarted Redis, a producer killed mid-submit, a dropped message) are sent again,
    # and shard load that no unfinished job holds is returned.
    requeue_interval: int = 10
    # Seconds a job's message may be missing before the job counts as stranded: longer than a
    # submit takes between recording its jobs and enqueueing them.
    stranded_grace: int = 30
    # Seconds a shard's worker may be silent before the shard counts as dead: its unfinished
    # jobs are routed again to live shards and its routing state is forgotten.
    shard_timeout: int = 60
    # The host name a worker gives in its heartbeat and Celery name; empty: the machine's.
    worker_host: str = ""
    # Largest accepted queue message after decompression, in bytes.
    max_message_bytes: int = 256 * 1024 * 1024
    flower_port: int = 5555
    # Each worker serves Prometheus metrics on this port plus its shard number; 0: none.
    metrics_port: int = 9400
    # The address workers serve them on: loopback, unless the scraper runs elsewhere (in
    # docker-compose, the containers' own network).
    metrics_address: str = "127.0.0.1"
    log_level: str = "INFO"
    # `jobsvc serve`: the bearer key every request must carry (empty: none asked), the largest
    # accepted upload, and the model name the OpenAI API shows and batch lines must name.
    api_key: str = ""
    max_upload_bytes: int = 200_000_000
    # Seconds a client may leave a request body waiting before the server gives up on it.
    body_read_timeout: int = 30
    served_model_name: str = "jobsvc"
    # What a worker's engine does (`jobsvc worker --task`): `generate` answers prompts, `embed`
    # runs the model as a pooling model and answers embedding requests.
    task: str = "generate"
    # LoRA adapters a generating worker loads at start and serves under their names, as
    # `NAME=PATH` pairs separated by commas (`jobsvc worker --lora NAME=PATH`, repeatable).
    loras: str = ""
    # How long a batch may run before it expires (OpenAI's "24h"); shorter only in tests.
    batch_window_seconds: int = 86_400
    # Seconds a server's claim on driving a batch lasts unless renewed (it renews every
    # second): after a crash, another server takes the batch over this long later.
    batch_lease_seconds: int = 30
    # vLLM's tool-call parser (its names, e.g. `hermes`) that finds the calls in the answer
    # of a chat line with tools and `tool_choice` auto; empty: such answers are text. Named
    # and required tool choices need none.
    tool_call_parser: str = ""
    # `jobsvc serve`: the endpoints each batch's end is POSTed to (`batch.completed`, ...),
    # separated by commas (empty: none), and the `whsec_` secret they are signed with as
    # OpenAI signs its webhooks (required with endpoints).
    webhook_urls: str = ""
    webhook_secret: str = ""
    # Seconds an attempt may take before it counts as refused; after a refusal, seconds
    # before the first retry, doubled at each further refusal up to the longest wait.
    webhook_timeout_seconds: float = 10.0
    webhook_retry_seconds: float = 5.0
    webhook_retry_max_seconds: float = 3600.0

    @property
    def job_limits(self) -> JobLimits:
        """What a job may hold and ask for, as every producer checks it."""
        return JobLimits(self.max_document_chars, self.max_question_chars, self.max_stop_chars,
                         self.max_job_bytes, self.scheduling_policy == "priority",
                         self.tool_call_parser or None)

    @property
    def resolved_database_url(self) -> str:
        """The database to use: JOBSVC_DATABASE_URL, else the embedded SQLite."""
        return self.database_url or EMBEDDED_DATABASE_URL

    @property
    def resolved_worker_host(self) -> str:
        """The host name workers report: JOBSVC_WORKER_HOST, else this machine's."""
        return self.worker_host or socket.gethostname()

    @property
    def resolved_dtype(self) -> str:
        """The engine's dtype: JOBSVC_DTYPE, else float32 for the tiny CPU model, else `auto`."""
        if self.dtype:
            return self.dtype
        return "float32" if Path(self.model).resolve() == TINY_MODEL else "auto"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read `JOBSVC_<NAME>` for every field; explicit overrides win over the environment."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in fields(cls):
            raw = environ.get(f"JOBSVC_{field.name.upper()}")
            if raw is not None:
                values[field.name] = _parse(field.name, field.type, raw)
        values.update({key: value for key, value in overrides.items() if value is not None})
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        """Refuse settings no part of the service can run with, naming the variable, before anything
        starts on them."""
        if self.shards < 1:
            raise ConfigurationError("JOBSVC_SHARDS must be at least 1")
        if self.block_size < 1 or self.batch_size < 1 or self.worker_concurrency < 1:
            raise ConfigurationError(
                "JOBSVC_BLOCK_SIZE, JOBSVC_BATCH_SIZE and JOBSVC_WORKER_CONCURRENCY must be >= 1")
        if not 0 <= self.worker_nice <= 19:
            raise ConfigurationError("JOBSVC_WORKER_NICE must be between 0 and 19")
        if self.admission_chunk < 0 or self.admission_pause_ms < 0:
            raise ConfigurationError(
                "JOBSVC_ADMISSION_CHUNK and JOBSVC_ADMISSION_PAUSE_MS must be >= 0")
        if self.visibility_timeout < 3 or self.max_attempts < 1 or self.requeue_interval < 1:
            raise ConfigurationError("JOBSVC_VISIBILITY_TIMEOUT must be >= 3 and "
                                     "JOBSVC_MAX_ATTEMPTS, JOBSVC_REQUEUE_INTERVAL >= 1")
        if self.stranded_grace < 1 or self.max_stop_chars < 1 or self.max_job_bytes < 1024:
            raise ConfigurationError("JOBSVC_STRANDED_GRACE and JOBSVC_MAX_STOP_CHARS must be "
                                     ">= 1 and JOBSVC_MAX_JOB_BYTES >= 1024")
        if self.shard_timeout < ALIVE_SECONDS:
            # Shorter, a draining worker between two heartbeats could count as dead and have
            # the jobs it runs moved.
            raise ConfigurationError(f"JOBSVC_SHARD_TIMEOUT must be >= {ALIVE_SECONDS:.0f} "
                                     "(three missed heartbeats)")
        if self.routing not in POLICY_NAMES:
            raise ConfigurationError(f"JOBSVC_ROUTING={self.routing!r} is not one of "
                                     f"{', '.join(POLICY_NAMES)}")
        if min(self.routing_load_weight, self.routing_load_slack, self.routing_decode_cost) < 0:
            raise ConfigurationError("JOBSVC_ROUTING_LOAD_WEIGHT, JOBSVC_ROUTING_LOAD_SLACK and "
                                     "JOBSVC_ROUTING_DECODE_COST must be >= 0")
        if self.dtype and self.dtype not in DTYPES:
            raise ConfigurationError(f"JOBSVC_DTYPE={self.dtype!r} is not one of "
                                     f"{', '.join(DTYPES)}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigurationError(f"JOBSVC_SCHEDULING_POLICY={self.scheduling_policy!r} is "
                                     f"not one of {', '.join(SCHEDULING_POLICIES)}")
        if not 1 <= self.zstd_level <= 22:
            raise ConfigurationError("JOBSVC_ZSTD_LEVEL must be between 1 and 22")
        if self.max_upload_bytes < 1 or self.batch_window_seconds < 1 or (
                self.body_read_timeout < 1):
            raise ConfigurationError("JOBSVC_MAX_UPLOAD_BYTES, JOBSVC_BATCH_WINDOW_SECONDS and "
                                     "JOBSVC_BODY_READ_TIMEOUT must be >= 1")
        if self.batch_lease_seconds < 3 or not self.served_model_name:
            raise ConfigurationError("JOBSVC_BATCH_LEASE_SECONDS must be >= 3 and "
                                     "JOBSVC_SERVED_MODEL_NAME not empty")
        if not 0 <= self.metrics_port <= 65535 - self.shards:
            raise ConfigurationError("JOBSVC_METRICS_PORT must be 0 (no worker metrics) or a "
                                     "port that leaves room for one port per shard above it")
        if self.tool_call_parser:
            _check_tool_call_parser(self.tool_call_parser)
        if self.task not in TASKS:
            raise ConfigurationError(f"JOBSVC_TASK={self.task!r} is not one of "
                                     f"{', '.join(TASKS)}")
        adapters = self.lora_modules
        if adapters and self.task != "generate":
            raise ConfigurationError("JOBSVC_LORAS: LoRA adapters are served by generating "
                                     "workers only")
        if self.served_model_name in adapters:
            raise ConfigurationError(f"JOBSVC_LORAS: adapter name {self.served_model_name!r} "
                                     "is the served model's own name")
        if self.webhook_endpoints:
            _webhook_key(self.webhook_secret)
        if not (self.webhook_timeout_seconds > 0
                and 0 < self.webhook_retry_seconds <= self.webhook_retry_max_seconds):
            raise ConfigurationError("JOBSVC_WEBHOOK_TIMEOUT_SECONDS and "
                                     "JOBSVC_WEBHOOK_RETRY_SECONDS must be > 0, and "
                                     "JOBSVC_WEBHOOK_RETRY_MAX_SECONDS at least the latter")

    @property
    def webhook_endpoints(self) -> tuple[str, ...]:
        """JOBSVC_WEBHOOK_URLS as distinct http(s) URLs, in the order given."""
        endpoints: dict[str, None] = {}
        for url in filter(None, (part.strip() for part in self.webhook_urls.split(","))):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigurationError(f"JOBSVC_WEBHOOK_URLS: {masked_url(url)!r} is not an "
                                         "http:// or https:// URL")
            endpoints[url] = None
        return tuple(endpoints)

    @property
    def webhook_key(self) -> bytes:
        """The key JOBSVC_WEBHOOK_SECRET gives webhook signatures."""
        return _webhook_key(self.webhook_secret)

    @property
    def lora_modules(self) -> dict[str, str]:
        """JOBSVC_LORAS as adapter name -> path, in the order given."""
        modules: dict[str, str] = {}
        for pair in filter(None, (part.strip() for part in self.loras.split(","))):
            name, _, path = pair.partition("=")
            name, path = name.strip(), path.strip()
            if not name or not path or name in modules:
                raise ConfigurationError(f"JOBSVC_LORAS: {pair!r} is not NAME=PATH with a "
                                         "name of its own")
            modules[name] = path
        return modules


def _check_tool_call_parser(name: str) -> None:
    """Refuse a tool-call parser vLLM does not have, before any line is read with it."""
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError:
        raise ConfigurationError("JOBSVC_TOOL_CALL_PARSER needs vllm installed (its parsers "
                                 "find the tool calls)") from None
    names = ToolParserManager.list_registered()
    if name not in names:
        raise ConfigurationError(f"JOBSVC_TOOL_CALL_PARSER={name!r} is not one of vLLM's "
                                 f"tool-call parsers: {', '.join(names)}")


def _webhook_key(secret: str) -> bytes:
    """The HMAC key of a webhook secret: the bytes its base64 after `whsec_` encodes, as
    OpenAI's and Standard Webhooks' verifiers decode it."""
    prefix, _, encoded = secret.partition("_")
    try:
        key = base64.b64decode(encoded, validate=True)
    except binascii.Error:
        key = b""
    if prefix != "whsec" or not key:
        # The secret itself is never shown.
        raise ConfigurationError("JOBSVC_WEBHOOK_SECRET must be set with JOBSVC_WEBHOOK_URLS, "
                                 "as whsec_ followed by the key in base64")
    return key


def masked_url(url: str) -> str:
    """The URL with its password replaced by `***`, for anything printed or logged."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _parse(name: str, kind: Any, raw: str) -> Any:
    kind_name = kind if isinstance(kind, str) else kind.__name__
    try:
        if kind_name == "int":
            return int(raw)
        if kind_name == "float":
            return float(raw)
        if kind_name == "bool":
            lowered = raw.strip().lower()
            if lowered not in {"1", "true", "yes", "on", "0", "false", "no", "off"}:
                raise ValueError(raw)
            return lowered in {"1", "true", "yes", "on"}
    except ValueError:
        raise ConfigurationError(
            f"JOBSVC_{name.upper()}={raw!r} is not a valid {kind_name}") from None
    return raw
