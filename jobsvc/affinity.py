"""Shard state shared by every producer and worker, in Redis: which shard holds each document
prefix, and how much work each shard still has outstanding (in prefill tokens, each job's
decode load included).

The choice for a new document is the pure `routing.least_loaded`; Redis only makes it shared.
A claim is HSETNX, so two producers racing on one new document agree on whoever came first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import redis

from jobsvc.routing import DocumentDemand, Placement, least_loaded

AFFINITY_KEY = "jobsvc:affinity"
LOAD_KEY = "jobsvc:load"

# Lowers a shard's load without going below zero (a counter lost with a Redis restart
# must not turn negative and attract every new document).
_RELEASE = """
for i = 1, #ARGV, 2 do
  local left = redis.call('HINCRBY', KEYS[1], ARGV[i], -tonumber(ARGV[i + 1]))
  if left < 0 then redis.call('HSET', KEYS[1], ARGV[i], 0) end
end
return 1
"""

# Moves each shard's load by a correction without going below zero; a value that is no
# integer a float can hold exactly (written by something else than jobsvc) is replaced by
# the shard's true load instead.
_CORRECT = """
for i = 1, #ARGV, 3 do
  local now = tonumber(redis.call('HGET', KEYS[1], ARGV[i]))
  local fixed = tonumber(ARGV[i + 2])
  if now ~= nil and now >= 0 and now <= 2^52 and now == math.floor(now) then
    fixed = math.max(0, now + tonumber(ARGV[i + 1]))
  end
  redis.call('HSET', KEYS[1], ARGV[i], string.format('%d', fixed))
end
return 1
"""


class ShardState:
    def __init__(self, client: redis.Redis, shards: int) -> None:
        self._redis = client
        self._shards = shards
        self._release = client.register_script(_RELEASE)
        self._correct = client.register_script(_CORRECT)

    def place(self, demands: Sequence[DocumentDemand]) -> list[Placement]:
        """Pick a shard per document (known documents stay put) and charge the shards.

        Round trips: one read, one claim-and-charge; a third only when another producer
        claimed one of the same new documents first, and then its choice wins."""
        keys = [demand.prefix_key for demand in demands]
        with self._redis.pipeline(transaction=False) as pipe:
            pipe.hmget(AFFINITY_KEY, keys)
            pipe.hgetall(LOAD_KEY)
            known, raw_loads = pipe.execute()
        loads = parse_loads(raw_loads, self._shards)
        placements: list[Placement] = []
        charges: dict[int, int] = {}
        for demand, value in zip(demands, known, strict=True):
            shard = int(value) if value is not None else self._shards
            placement = (Placement(shard, False) if shard < self._shards
                         else Placement(least_loaded(loads), True))
            cost = demand.cost_if_new if placement.is_new else demand.cost_if_known
            loads[placement.shard] += cost
            charges[placement.shard] = charges.get(placement.shard, 0) + cost
            placements.append(placement)
        claims = [index for index, placement in enumerate(placements) if placement.is_new]
        with self._redis.pipeline(transaction=False) as pipe:
            for index in claims:
                pipe.hsetnx(AFFINITY_KEY, keys[index], placements[index].shard)
            for shard, tokens in charges.items():
                pipe.hincrby(LOAD_KEY, str(shard), tokens)
            won = pipe.execute()[:len(claims)]
        lost = [index for index, ok in zip(claims, won, strict=True) if not ok]
        if lost:
            self._defer_to_winners(lost, keys, demands, placements)
        return placements

    def _defer_to_winners(self, lost: list[int], keys: list[str],
                          demands: Sequence[DocumentDemand], placements: list[Placement]) -> None:
        winners = self._redis.hmget(AFFINITY_KEY, [keys[index] for index in lost])
        undo: dict[int, int] = {}
        redo: dict[int, int] = {}
        for index, value in zip(lost, winners, strict=True):
            ours, theirs = placements[index].shard, int(value)
            undo[ours] = undo.get(ours, 0) + demands[index].cost_if_new
            redo[theirs] = redo.get(theirs, 0) + demands[index].cost_if_known
            placements[index] = Placement(theirs, False)
        self.release(undo)
        self.charge(redo)

    def charge(self, charges: Mapping[int, int]) -> None:
        if charges:
            with self._redis.pipeline(transaction=False) as pipe:
                for shard, tokens in charges.items():
                    pipe.hincrby(LOAD_KEY, str(shard), tokens)
                pipe.execute()

    def release(self, releases: Mapping[int, int]) -> None:
        """Return finished jobs' loads to their shards."""
        args: list[int | str] = []
        for shard, tokens in releases.items():
            if tokens:
                args += [str(shard), tokens]
        if args:
            self._release(keys=[LOAD_KEY], args=args)

    def loads(self) -> dict[int, int | None]:
        """Every shard's recorded load; None where the value is not a load."""
        return {int(shard): _load_value(value) for shard, value
                in self._redis.hgetall(LOAD_KEY).items() if shard.isdigit()}

    def correct(self, corrections: Mapping[int, tuple[int, int]]) -> None:
        """Move shards' loads by (delta, true load) each: by delta, or to the true load where
        the recorded one is unreadable."""
        args: list[int | str] = []
        for shard, (delta, true_load) in corrections.items():
            args += [str(shard), delta, true_load]
        if args:
            self._correct(keys=[LOAD_KEY], args=args)


_LARGEST_LOAD = 1 << 52


def _load_value(raw: bytes | None) -> int | None:
    try:
        value = int(raw or 0)
    except ValueError:
        return None
    return value if 0 <= value <= _LARGEST_LOAD else None


def parse_loads(raw: Mapping[bytes, bytes], shards: int) -> list[int]:
    """Per-shard outstanding work from the load hash (a missing shard has none; one whose
    value is not a load counts as full, until reconciliation repairs it)."""
    return [_LARGEST_LOAD if (value := _load_value(raw.get(str(shard).encode()))) is None
            else value for shard in range(shards)]
