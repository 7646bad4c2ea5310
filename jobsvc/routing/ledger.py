"""The load ledger: how much work each shard still has outstanding, in prefill tokens (each
job's decode load included), kept in Redis so that every producer, worker and reconciler
counts on one set of counters.

Routers charge it when they place jobs, workers release it when jobs end, a submit or a move
gives back what it charged for jobs it did not keep, and the reconciler corrects it towards
what the store says the unfinished jobs hold. Every one of them goes through `LoadLedger`.
The rules are those of `RoutingPolicy.charge`/`job_finished` (a load never goes below zero);
Redis applies them in scripts so that concurrent writers never undo each other's counts, and
`tests/integration/test_ledger_agrees.py` checks that scripts and policy agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import redis
from redis.client import Pipeline

from jobsvc.keys import LOAD_KEY

# Lowers a shard's load without going below zero (a counter lost with a Redis restart
# must not turn negative and attract every new document).
_RELEASE = """
for i = 1, #ARGV, 2 do
  local left = redis.call('HINCRBY', KEYS[1], ARGV[i], -tonumber(ARGV[i + 1]))
  if left < 0 then redis.call('HSET', KEYS[1], ARGV[i], 0) end
end
return 1
"""

# Moves each shard's load by a correction without going below zero; a value that is not a
# load as `load_value` reads one (decimal digits, at most LARGEST_LOAD; written by something
# else than jobsvc) is replaced by the shard's true load instead.
_CORRECT = """
for i = 1, #ARGV, 3 do
  local raw = redis.call('HGET', KEYS[1], ARGV[i])
  local fixed = tonumber(ARGV[i + 2])
  if raw and string.find(raw, '^%d+$') then
    local now = tonumber(raw)
    if now <= 2^52 then fixed = math.max(0, now + tonumber(ARGV[i + 1])) end
  end
  redis.call('HSET', KEYS[1], ARGV[i], string.format('%d', fixed))
end
return 1
"""

# The largest value read as a load: every integer up to it is exact in the scripts' doubles.
LARGEST_LOAD = 1 << 52


class LoadLedger:
    """The shards' load counters in Redis, changed only through here: charges in pipelines,
    releases and corrections in atomic scripts."""

    def __init__(self, client: redis.Redis) -> None:
        self._redis = client
        self._release = client.register_script(_RELEASE)
        self._correct = client.register_script(_CORRECT)

    def charge(self, charges: Mapping[int, int], *, pipe: Pipeline | None = None) -> None:
        """Add routed jobs' loads to their shards' counters: on `pipe` if given (a router
        writing its decisions in one round trip), else in one round trip of its own."""
        if pipe is not None:
            for shard, tokens in charges.items():
                pipe.hincrby(LOAD_KEY, str(shard), tokens)
            return
        if charges:
            with self._redis.pipeline(transaction=False) as own:
                self.charge(charges, pipe=own)
                own.execute()

    def release(self, releases: Mapping[int, int]) -> None:
        """Return loads to their shards (jobs that ended, or that a submit or move charged
        and did not keep), never below zero."""
        args: list[int | str] = []
        for shard, tokens in releases.items():
            if tokens:
                args += [str(shard), tokens]
        if args:
            self._release(keys=[LOAD_KEY], args=args)

    def correct(self, corrections: Mapping[int, tuple[int, int]]) -> None:
        """Move shards' loads by (delta, true load) each: by delta, never below zero, or to
        the true load where the recorded one is missing or unreadable."""
        args: list[int | str] = []
        for shard, (delta, true_load) in corrections.items():
            args += [str(shard), delta, true_load]
        if args:
            self._correct(keys=[LOAD_KEY], args=args)

    def loads(self) -> dict[int, int | None]:
        """Every shard's recorded load; None where the value is not a load."""
        return {int(shard): load_value(value) for shard, value
                in self._redis.hgetall(LOAD_KEY).items() if shard.isdigit()}


def load_value(raw: bytes | None) -> int | None:
    """A recorded load as the ledger reads it: missing is 0; anything but decimal digits of
    at most LARGEST_LOAD is no load (None)."""
    if raw is None:
        return 0
    if not raw.isdigit():
        return None
    value = int(raw)
    return value if value <= LARGEST_LOAD else None


def loads_of(raw: Mapping[bytes, bytes], shards: Sequence[int]) -> list[int]:
    """Outstanding work of these shards, in their order, from the load hash (a missing shard
    has none; one whose value is not a load counts as full, until reconciliation repairs
    it)."""
    return [LARGEST_LOAD if (value := load_value(raw.get(str(shard).encode()))) is None
            else value for shard in shards]
