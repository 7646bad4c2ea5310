"""Routing: which shard runs each job.

`prefix` hashes documents into block chains and keys, `job_cost` says what a job costs its
shard, `policies` decides (pure logic, shared by the routers and the simulator), `router` runs
the policies over their shared state in Redis, `ledger` charges, releases and corrects the
shards' loads, `affinity` holds the affinity map, `live` the shards routed to, and `feedback`
carries what workers report back about their caches.
"""
