"""The affinity map in Redis: which shard holds each document prefix, shared by every
producer that routes with the `affinity` policy.

Decisions are the pure policy's (`routing.policies.AffinityPolicy`); Redis only makes its state
shared, and the load ledger (`routing.ledger`) its loads. A claim sets an entry only where
none is, or where the one there names a shard that has left the fleet, so two producers racing
on one new document agree on whoever came first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import redis

from jobsvc.keys import AFFINITY_KEY, LOAD_KEY
from jobsvc.routing.job_cost import DocumentDemand, loads_per_shard
from jobsvc.routing.ledger import LoadLedger, loads_of
from jobsvc.routing.policies import Placement

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


class AffinityMap:
    """Documents' shards in Redis, claimed by an atomic script so that producers racing on one
    new document agree; the loads the claims cost go to the ledger in the same round trip."""

    def __init__(self, client: redis.Redis, ledger: LoadLedger) -> None:
        self._redis = client
        self._ledger = ledger
        self._claim = client.register_script(_CLAIM)

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
            self._ledger.charge(charges, pipe=pipe)
            won = pipe.execute()[0] if claims else []
        lost = [index for index, ok in zip(claims, won, strict=True) if not ok]
        if lost:
            self._defer_to_winners(lost, keys, demands, placements)
        return placements

    def _defer_to_winners(self, lost: list[int], keys: list[str],
                          demands: Sequence[DocumentDemand], placements: list[Placement]) -> None:
        winners = [int(value) for value in
                   self._redis.hmget(AFFINITY_KEY, [keys[index] for index in lost])]
        self._ledger.release(loads_per_shard(
            (placements[index].shard, demands[index].cost_if_new) for index in lost))
        self._ledger.charge(loads_per_shard(
            (shard, demands[index].cost_if_known)
            for index, shard in zip(lost, winners, strict=True)))
        for index, shard in zip(lost, winners, strict=True):
            placements[index] = Placement(shard, False)
