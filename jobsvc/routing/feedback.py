"""What workers report back to the router, through Redis, so that its estimate of their KV
caches follows what the engines really hold."""

from __future__ import annotations

from collections.abc import Mapping

import redis

from jobsvc.keys import CACHE_KEY_PREFIX, CAPACITY_KEY, REPORTED_CAPACITY_KEY, cache_key

# Moves a shard's learned capacity by the summed error of its jobs' cache expectations (in
# blocks), within [longest chain seen or one block, reported capacity], and forgets what no
# longer fits: `CacheAwarePolicy.learn`, atomic in Redis.
_LEARN = """
for i = 1, #ARGV, 3 do
  local shard, error = ARGV[i], tonumber(ARGV[i + 1])
  local floor = math.max(1, tonumber(ARGV[i + 2]))
  local reported = tonumber(redis.call('HGET', KEYS[1], shard))
  if reported then
    local current = tonumber(redis.call('HGET', KEYS[2], shard)) or reported
    local learned = math.min(reported, math.max(floor, current - error))
    redis.call('HSET', KEYS[2], shard, learned)
    redis.call('ZREMRANGEBYRANK', KEYS[3] .. shard, 0, -learned - 1)
  end
end
return 1
"""


class CacheFeedback:
    """What workers tell the cache-aware router: the size of their engine's KV cache when it
    starts (empty), and after each drain of results how far the cached tokens their jobs
    really got fell short of (or beyond) what the router expected."""

    def __init__(self, client: redis.Redis) -> None:
        self._redis = client
        self._learn = client.register_script(_LEARN)

    def engine_started(self, shard: int, capacity_blocks: int) -> None:
        """A shard's engine (re)started with an empty cache of `capacity_blocks`: forget what the
        router thought it held and take its size as reported."""
        with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(cache_key(shard))
            pipe.hset(REPORTED_CAPACITY_KEY, str(shard), capacity_blocks)
            pipe.hset(CAPACITY_KEY, str(shard), capacity_blocks)
            pipe.execute()

    def jobs_ran(self, errors: Mapping[int, tuple[int, int]]) -> None:
        """`errors` maps a shard to (expected minus actual cached blocks summed over its jobs,
        the longest document chain among them in blocks)."""
        args: list[int | str] = []
        for shard, (error, floor) in errors.items():
            args += [str(shard), error, floor]
        if args:
            self._learn(keys=[REPORTED_CAPACITY_KEY, CAPACITY_KEY, CACHE_KEY_PREFIX], args=args)

