"""Every Redis key and channel the service uses, named once: producers, workers, operators'
scripts and tests import them from here, so two parts can never disagree on a name and an
operator finds all of them in one place."""

from __future__ import annotations

# Shard queues. Their names are public: Flower, `jobsvc_queue_messages` and operators show them.
_QUEUE_PREFIX = "jobs.shard."
# Matches every shard queue (for KEYS or SCAN).
ALL_QUEUES_PATTERN = f"{_QUEUE_PREFIX}*"


def queue_name(shard: int) -> str:
    """The Redis queue of `shard`'s messages."""
    return f"{_QUEUE_PREFIX}{shard}"


def shard_of_queue(key: bytes | str) -> int | None:
    """The shard whose queue `key` is, or None for any other key."""
    return _shard_after(_QUEUE_PREFIX, key)


# kombu's Redis transport keeps unacknowledged messages in this hash (delivery tag -> message)
# and this sorted set scored by delivery time; workers renew their leases by re-scoring them.
UNACKED_KEY = "unacked"
UNACKED_INDEX_KEY = "unacked_index"

# Job IDs to cancel, published to every worker.
CANCEL_CHANNEL = "jobsvc:cancel"

# Held by the reconciler running a round, so that two never send the same stranded jobs.
RECONCILE_LOCK_KEY = "jobsvc:reconcile-lock"
# Where reconciliation has got to (hash: `server`, the Redis run it belongs to; `checked`,
# the send time and job ID up to which every new message was checked; `bucket`, the range of
# message IDs its sweep checks next). Gone, or naming another run of the server, it means
# Redis restarted or never held any: the next round checks every job.
RECONCILED_KEY = "jobsvc:reconciled"
# Job IDs of messages a worker's task ended on with an error (a set): the next round checks
# them at once, since their message is gone but they may be unfinished.
DROPPED_JOBS_KEY = "jobsvc:dropped-jobs"
_MESSAGES_PREFIX = "jobsvc:messages:"


def messages_key(shard: int) -> str:
    """The IDs of `shard`'s messages Redis holds, queued or leased (a set): added when a
    message is published, removed when a worker has finished it. Reconciliation asks it
    whether a job's message still exists instead of reading whole queues."""
    return f"{_MESSAGES_PREFIX}{shard}"


def dead_letter_key(queue: str) -> str:
    """Items of `queue` that were no message at all, kept for inspection (a bounded list)."""
    return f"jobsvc:dead-letter:{queue}"


# Outstanding work per shard (hash: shard -> load), charged by producers, returned by workers.
LOAD_KEY = "jobsvc:load"
# affinity: the shard of each document prefix (hash: prefix key -> shard).
AFFINITY_KEY = "jobsvc:affinity"
# round_robin: the count of jobs dealt so far, shared by every producer.
ROUND_ROBIN_KEY = "jobsvc:round-robin"
# cache_aware: per shard, the block hashes its KV cache is estimated to hold (sorted set scored
# by recency), the recency clock, and the cache capacity in blocks as its worker reported it
# and as the router has learned it (hashes: shard -> blocks).
CACHE_KEY_PREFIX = "jobsvc:cache:"
CACHE_CLOCK_KEY = "jobsvc:cache-clock"
REPORTED_CAPACITY_KEY = "jobsvc:cache-reported"
CAPACITY_KEY = "jobsvc:cache-capacity"
# cache_aware: held by a producer while it reads, decides on and writes back the estimate.
ROUTING_LOCK_KEY = "jobsvc:routing-lock"


def cache_key(shard: int) -> str:
    """The sorted set of block hashes `shard`'s KV cache is estimated to hold."""
    return f"{CACHE_KEY_PREFIX}{shard}"


# Each shard's worker heartbeat: a JSON record it rewrites every few seconds, expiring long
# after the worker counts as gone, so operators still see when it was last seen.
_HEARTBEAT_PREFIX = "jobsvc:worker:"
ALL_HEARTBEATS_PATTERN = f"{_HEARTBEAT_PREFIX}*"


def heartbeat_key(shard: int) -> str:
    """Where `shard`'s worker writes its heartbeat."""
    return f"{_HEARTBEAT_PREFIX}{shard}"


def shard_of_heartbeat(key: bytes | str) -> int | None:
    """The shard whose heartbeat `key` is, or None for any other key."""
    return _shard_after(_HEARTBEAT_PREFIX, key)


def _shard_after(prefix: str, key: bytes | str) -> int | None:
    """The shard number after `prefix` in a key as Redis returns it (bytes) or as named."""
    text = key.decode(errors="replace") if isinstance(key, bytes) else key
    suffix = text[len(prefix):] if text.startswith(prefix) else ""
    return int(suffix) if suffix.isdigit() else None


# Shards an operator is taking out of service (`jobsvc drain`): a set of shard numbers that
# routers leave out and whose workers stop once their work is done.
DRAINING_KEY = "jobsvc:draining"
# Every model and adapter a worker ever served, by name (`jobsvc.served_models`), and the names
# each shard served last.
MODELS_KEY = "jobsvc:models"
SHARD_MODELS_KEY = "jobsvc:shard-models"
# Shards found dead whose routing state (affinity entries, load, cache estimate) has been
# forgotten; a worker that starts (or is seen alive again) under such a number takes it out.
DEPARTED_KEY = "jobsvc:departed"
# Shards known to reconcilers (by their jobs) that have no heartbeat key: shard -> the Redis
# server time at which that absence was first seen, from which their silence counts.
SILENT_SINCE_KEY = "jobsvc:silent_since"
