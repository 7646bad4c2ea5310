"""Shard state shared by every producer and worker, in Redis: how much work each shard still
has outstanding (in prefill tokens, each job's decode load included), which shard holds each
document prefix (the affinity map).

Decisions are the pure policies' (`routing.policies`); Redis only makes their state shared.
A claim in the affinity map sets an entry only where none is, or where the one there names a
shard that has left the fleet, so two producers racing on one new document agree on whoever
came first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import redis

from jobsvc.keys import AFFINITY_KEY, LOAD_KEY
from jobsvc.routing.job_cost import DocumentDemand, loads_per_shard
from jobsvc.routing.policies import Placement

# Lowers a shard's load without going below zero (a counter lost with a Redis restart
# must not turn negative and attract every new document).
_RELEASE = """
for i = 1, #ARGV, 2 do
  local left = redis.call('HINCRBY', KEYS[1], ARGV[i], -tonumber(ARGV[i + 1]))
  if left < 0 then redis.call('HSET', KEYS[1], ARGV[i], 0) end
end
return 1
"""

# Claims documents in the affinity map: ARGV holds (prefix key, shard, the shard the entry
# named when it was read, or "" for none) triples; an entry is written only where there is none
# or it still names what was read. Returns 1 per won claim, 0 per lost one.
_CLAIM = """
local won = {}
for i = 1, #ARGV, 3 do
  local now = redis.call('HGET', KEYS[1], ARGV[i]) or ''
  if now == '' or now == ARGV[i + 2] then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    won[#won + 1] = 1
  else
    won[#won + 1] = 0
  end
end
return won
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
    """The shards' loads and the affinity map in Redis, changed only by atomic scripts and pipelines
    so that producers and workers never undo each other's counts."""

    def __init__(self, client: redis.Redis) -> None:
        self._redis = client
        self._claim = client.register_script(_CLAIM)
        self._release = client.register_script(_RELEASE)
        self._correct = client.register_script(_CORRECT)

    def placements_and_loads(self, prefix_keys: Sequence[str], live: Sequence[int]
                             ) -> tuple[dict[str, int], dict[str, int], list[int]]:
        """In one round trip: the live shards already holding any of these documents, the
        shards outside `live` that entries name for others (those documents are placed anew),
        and the live shards' loads in `live`'s order."""
        with self._redis.pipeline(transaction=False) as pipe:
            pipe.hmget(AFFINITY_KEY, prefix_keys)
            pipe.hgetall(LOAD_KEY)
            known, raw_loads = pipe.execute()
        members = set(live)
        placed: dict[str, int] = {}
        departed: dict[str, int] = {}
        for key, value in zip(prefix_keys, known, strict=True):
            if value is not None and value.isdigit():
                (placed if int(value) in members else departed)[key] = int(value)
        return placed, departed, loads_of(raw_loads, live)

    def claim(self, demands: Sequence[DocumentDemand], placements: Sequence[Placement],
              departed: Mapping[str, int]) -> list[Placement]:
        """Record where the new documents went and charge the shards; returns the placements
        that hold. `departed`: the shards that entries named, when read, for documents placed
        anew because those shards left. Round trips: one; a second only when another producer
        claimed one of the same new documents first, and then its choice wins."""
        keys = [demand.prefix_key for demand in demands]
        placements = list(placements)
        claims = [index for index, placement in enumerate(placements) if placement.is_new]
        charges = loads_per_shard((placement.shard, demand.cost(placement.is_new))
                                  for demand, placement in zip(demands, placements, strict=True))
        claim_args: list[str | int] = []
        for index in claims:
            claim_args += [keys[index], placements[index].shard,
                           str(departed.get(keys[index], ""))]
        with self._redis.pipeline(transaction=False) as pipe:
            if claims:
                self._claim(keys=[AFFINITY_KEY], args=claim_args, client=pipe)
            for shard, tokens in charges.items():
                pipe.hincrby(LOAD_KEY, str(shard), tokens)
            won = pipe.execute()[0] if claims else []
        lost = [index for index, ok in zip(claims, won, strict=True) if not ok]
        if lost:
            self._defer_to_winners(lost, keys, demands, placements)
        return placements

    def _defer_to_winners(self, lost: list[int], keys: list[str],
                          demands: Sequence[DocumentDemand], placements: list[Placement]) -> None:
        winners = [int(value) for value in
                   self._redis.hmget(AFFINITY_KEY, [keys[index] for index in lost])]
        self.release(loads_per_shard((placements[index].shard, demands[index].cost_if_new)
                                     for index in lost))
        self.charge(loads_per_shard((shard, demands[index].cost_if_known)
                                    for index, shard in zip(lost, winners, strict=True)))
        for index, shard in zip(lost, winners, strict=True):
            placements[index] = Placement(shard, False)

    def charge(self, charges: Mapping[int, int]) -> None:
        """Add routed jobs' loads to their shards' counters, in one round trip."""
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


def loads_of(raw: Mapping[bytes, bytes], shards: Sequence[int]) -> list[int]:
    """Outstanding work of these shards, in their order, from the load hash (a missing shard
    has none; one whose value is not a load counts as full, until reconciliation repairs
    it)."""
    return [_LARGEST_LOAD if (value := _load_value(raw.get(str(shard).encode()))) is None
            else value for shard in shards]
