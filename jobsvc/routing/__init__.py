"""Routing: which shard runs each job.

`prefix` hashes documents into block chains and keys, `cost` says what a job costs its shard,
`policies` decides (pure logic, shared by the routers and the simulator), `router` runs the
policies over their shared state in Redis, `state` holds the shards' loads, the affinity map
and `feedback` carries what workers report back about their caches.
"""
