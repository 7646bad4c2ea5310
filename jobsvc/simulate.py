"""Replay a workload over simulated shards to compare routing policies without GPUs.

The shards are chosen by the service's own policies (`routing.policies`), with the service's
defaults. Each shard is a server that runs its queue in order, with an LRU cache of prefix
blocks that decides the real hits; a job costs `prefill_cost` per prompt token its shard did not
have cached plus its decode load (`routing.job_cost.decode_load`: `decode_cost` per output token).
By default the whole workload is one burst at time 0, the way `submit_many` and the benchmarks
send it: nothing finishes while jobs are routed, outstanding work only grows, and balance comes
from the policy (its load weight and bound). With an arrival rate, job i arrives at i / rate
and a shard's outstanding work is what its server has left then.

Shards may join and leave mid-run (`FleetChange`): the policy follows the live set as the
service's routers do (dense indices over the live shard numbers, a departed shard's state
forgotten, `RoutingPolicy.reindex`); a shard that leaves finishes what it was given, one that
joins starts with an empty cache. Per change the report gives the share of documents asked
again after it that went to another shard than before, next to the 1/N floor, and the hit
rate of the jobs before and after it.

Workloads are generated as block-id chains (ints, no tokenizer) or read from a JSONL file of
jobs, tokenized and hashed the way the client does it.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import accumulate, pairwise
from pathlib import Path
from typing import Any

from jobsvc.errors import JobsvcError
from jobsvc.routing.job_cost import DEFAULT_CAPACITY_BLOCKS, DEFAULT_DECODE_COST, decode_load
from jobsvc.routing.policies import DEFAULT_EPSILON, DEFAULT_WEIGHT, POLICY_NAMES, make_policy
from jobsvc.routing.prefix import block_hashes
from jobsvc.settings import TINY_MODEL, Settings
from jobsvc.workloads import read_jsonl_jobs

WORKLOAD_NAMES = ("unique", "reuse", "zipf", "hot", "shared-preamble")
# Skew of the `zipf` workload: of 256 documents, the most asked one draws a fifth of the jobs.
ZIPF_EXPONENT = 1.1

# Work per uncached prompt token: 1 counts work in prefill tokens, the router's unit of load.
DEFAULT_PREFILL_COST = 1
DEFAULT_SHARDS = 8

# A job: its document's block chain, its prompt tokens, its output tokens.
Job = tuple[Sequence[int], int, int]


class WorkloadError(JobsvcError):
    """A workload could not be built or read."""


@dataclass(frozen=True)
class FleetChange:
    """A shard joining or leaving before job number `at_job` (0-based) is routed."""

    at_job: int
    kind: str
    shard: int


FLEET_CHANGE_KINDS = ("join", "leave")


def parse_changes(text: str) -> list[FleetChange]:
    """`KIND:SHARD@JOB,...`, e.g. `leave:3@250000,join:64@500000`."""
    changes = []
    for part in filter(None, (item.strip() for item in text.split(","))):
        kind, _, rest = part.partition(":")
        shard, _, at_job = rest.partition("@")
        if kind not in FLEET_CHANGE_KINDS or not shard.isdigit() or not at_job.isdigit():
            raise WorkloadError(f"fleet change {part!r} is not KIND:SHARD@JOB with KIND one of "
                                f"{', '.join(FLEET_CHANGE_KINDS)} (e.g. leave:3@1000)")
        changes.append(FleetChange(int(at_job), kind, int(shard)))
    return sorted(changes, key=lambda change: change.at_job)


def changed_fleet(live: Sequence[int], change: FleetChange) -> list[int]:
    """The live shard numbers after a change, in order."""
    if change.kind == "join":
        if change.shard in live:
            raise WorkloadError(f"shard {change.shard} joins at job {change.at_job} but is live")
        return sorted([*live, change.shard])
    if change.shard not in live or len(live) == 1:
        raise WorkloadError(f"shard {change.shard} leaves at job {change.at_job} but is not "
                            "live, or is the last live shard")
    return [shard for shard in live if shard != change.shard]


@dataclass
class _ChangeWindow:
    """What the jobs routed between one fleet change and the next did."""

    change: FleetChange | None
    shards: int
    # Documents routed before the change, by the shard they went to then.
    placed_before: dict[int, int]
    asked_again: int = 0
    remapped: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0

    def report(self, hit_rate_before: float | None) -> dict[str, Any]:
        assert self.change is not None
        # A shard that leaves must give up its documents; one that joins must draw its share.
        floor = 1 / (self.shards + 1 if self.change.kind == "leave" else self.shards)
        return {**asdict(self.change), "shards_after": self.shards,
                "documents_asked_again": self.asked_again,
                "remapped_share": self.remapped / self.asked_again if self.asked_again else 0.0,
                "floor": floor, "hit_rate_before": hit_rate_before,
                "hit_rate_after": self.hit_rate}

    @property
    def hit_rate(self) -> float | None:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else None


@dataclass(frozen=True)
class WorkloadShape:
    """Sizes of a generated workload; every prompt is one document plus a question tail."""

    jobs: int = 10_000
    # `unique` has one document per job whatever this says.
    documents: int = 256
    blocks_per_document: int = 12
    block_size: int = 128
    question_tokens: int = 16
    output_tokens: int = 16
    seed: int = 0
    # `shared-preamble`: documents in consecutive groups of `group_size` share their first
    # `preamble_blocks` blocks (a common preamble, or versions of one text).
    preamble_blocks: int = 8
    group_size: int = 8


@dataclass(frozen=True)
class Workload:
    """A workload for the simulator: its jobs as block IDs, produced as they are replayed."""

    name: str
    block_size: int
    # Block ids are 0 .. block_ids - 1, so a bytearray can mark the ones already seen.
    block_ids: int
    # Consumed once; generated lazily so a million jobs take no list.
    jobs: Iterable[Job]


def generate(name: str, shape: WorkloadShape) -> Workload:
    """The named synthetic workload, deterministic for a given shape and seed."""
    if name not in WORKLOAD_NAMES:
        raise WorkloadError(f"unknown workload {name!r}; use one of {', '.join(WORKLOAD_NAMES)} "
                            "or the path of a .jsonl file")
    documents = shape.jobs if name == "unique" else shape.documents
    length = shape.blocks_per_document
    if shape.jobs < 1 or documents < (2 if name == "hot" else 1) or length < 1:
        raise WorkloadError(f"workload {name!r} needs jobs >= 1, blocks per document >= 1 and "
                            f"documents >= {2 if name == 'hot' else 1}")
    prompt_tokens = length * shape.block_size + shape.question_tokens
    order = _document_order(name, shape.jobs, documents, random.Random(shape.seed))
    if name == "shared-preamble":
        chains, block_ids = _preamble_chains(documents, shape)
        jobs: Iterator[Job] = ((chains[doc], prompt_tokens, shape.output_tokens)
                               for doc in order)
    else:
        block_ids = documents * length
        jobs = ((range(doc * length, doc * length + length), prompt_tokens, shape.output_tokens)
                for doc in order)
    return Workload(name, shape.block_size, block_ids, jobs)


def _document_order(name: str, jobs: int, documents: int, rng: random.Random) -> Iterator[int]:
    if name == "unique":
        return iter(range(jobs))
    if name == "zipf":
        bounds = list(accumulate(1 / rank ** ZIPF_EXPONENT for rank in range(1, documents + 1)))
        return (bisect_right(bounds, rng.random() * bounds[-1]) for _ in range(jobs))
    if name == "hot":
        return (0 if rng.random() < 0.5 else rng.randrange(1, documents) for _ in range(jobs))
    return _rounds(jobs, documents, rng)


def _rounds(jobs: int, documents: int, rng: random.Random) -> Iterator[int]:
    """reuse, shared-preamble: every document is asked once per round, in a new order each
    round, the way independent users would ask."""
    order = list(range(documents))
    for start in range(0, jobs, documents):
        rng.shuffle(order)
        yield from order[:jobs - start]


def _preamble_chains(documents: int, shape: WorkloadShape) -> tuple[list[tuple[int, ...]], int]:
    shared, length = shape.preamble_blocks, shape.blocks_per_document
    if not 0 < shared < length or shape.group_size < 1:
        raise WorkloadError("shared-preamble needs 0 < preamble blocks < blocks per document "
                            "and a group size >= 1")
    groups = -(-documents // shape.group_size)
    own = length - shared
    first_own = groups * shared
    chains = [tuple(range(doc // shape.group_size * shared, (doc // shape.group_size + 1) * shared))
              + tuple(range(first_own + doc * own, first_own + (doc + 1) * own))
              for doc in range(documents)]
    return chains, first_own + documents * own


def load_jsonl(path: Path, *, block_size: int, output_tokens: int,
               model: str = str(TINY_MODEL)) -> Workload:
    """Jobs from a JSONL file (`document`, `question`, optional `max_tokens` per line, as for
    `jobsvc bench`), with prompts tokenized and block hashes chained as the client does."""
    from jobsvc.prompts import PromptBuilder

    rows = read_jsonl_jobs(path)
    prompts = PromptBuilder(model)
    distinct = list(dict.fromkeys(row["document"] for row in rows))
    questions = prompts.questions([row["question"] for row in rows])
    # Block hashes become dense ints: cheaper cache keys, and the ideal's bytearray indexes them.
    ids: dict[bytes, int] = {}
    documents: dict[str, tuple[list[int], int]] = {}
    for text, tokens in zip(distinct, prompts.documents(distinct), strict=True):
        chain = [ids.setdefault(block, len(ids)) for block in block_hashes(tokens, block_size)]
        documents[text] = (chain, len(tokens))
    jobs: list[Job] = []
    for row, question in zip(rows, questions, strict=True):
        chain, document_tokens = documents[row["document"]]
        jobs.append((chain, document_tokens + len(question),
                     int(row.get("max_tokens", output_tokens))))
    return Workload(path.name, block_size, len(ids), jobs)


def run_simulation(workload: Workload, *, shards: int, policy: str, cache_blocks: int,
                   prefill_cost: int = DEFAULT_PREFILL_COST,
                   decode_cost: float = DEFAULT_DECODE_COST,
                   arrival_rate: float | None = None, weight: float = DEFAULT_WEIGHT,
                   epsilon: float = DEFAULT_EPSILON,
                   changes: Sequence[FleetChange] = ()) -> dict[str, Any]:
    """Route every job with `policy`, serve it on its shard, and report hits, balance and time.

    The router is told each shard's cache size, as workers report it; its own estimate of what
    the caches hold is left to the policy."""
    if cache_blocks < 1 or shards < 1 or (arrival_rate is not None and arrival_rate <= 0):
        raise WorkloadError("shards and cache blocks must be >= 1 and an arrival rate > 0")
    started = time.perf_counter()
    router = make_policy(policy, shards, block_size=workload.block_size,
                         capacity_blocks=cache_blocks, weight=weight, epsilon=epsilon)
    choose, charge = router.choose, router.charge
    # Shard numbers ever used; the policy picks an index into `live`.
    numbers = max([shards - 1, *(change.shard for change in changes)]) + 1
    live = list(range(shards))
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(numbers)]
    seen = bytearray(workload.block_ids)
    block_size = workload.block_size
    shard_jobs = [0] * numbers
    shard_work = [0] * numbers
    # When each shard's server will have run everything queued on it so far.
    done_at = [0.0] * numbers
    now = 0.0
    jobs = hit_tokens = ideal_tokens = prompt_total = 0
    pending = list(changes)
    # Each document's shard (by its chain's last block), kept only to measure remapping.
    placed: dict[int, int] | None = {} if changes else None
    windows = [_ChangeWindow(None, shards, {})]
    for jobs, (chain, prompt_tokens, output_tokens) in enumerate(workload.jobs, 1):
        while pending and pending[0].at_job < jobs:
            change = pending.pop(0)
            after = changed_fleet(live, change)
            router.reindex([live.index(shard) if shard in live else None for shard in after])
            caches[change.shard] = OrderedDict()
            live = after
            windows.append(_ChangeWindow(change, len(live), dict(placed or {})))
        if arrival_rate is not None:
            now = (jobs - 1) / arrival_rate
            router.loads[:] = [int(done_at[shard] - now) if done_at[shard] > now else 0
                               for shard in live]
        length = len(chain)
        ideal = 0
        while ideal < length and seen[chain[ideal]]:
            ideal += 1
        for block in chain[ideal:]:
            seen[block] = 1

        index = choose(chain, prompt_tokens)
        shard = live[index]
        cache = caches[shard]
        cached = 0
        while cached < length and chain[cached] in cache:
            cached += 1
        # Last block first, so the prefix is the most recent and the tail is evicted first.
        for block in reversed(chain[cached:]):
            cache[block] = None
        for block in reversed(chain[:cached]):
            cache.move_to_end(block)
        for _ in range(len(cache) - cache_blocks):
            cache.popitem(last=False)

        work = ((prompt_tokens - cached * block_size) * prefill_cost
                + decode_load(output_tokens, decode_cost))
        charge(index, work)
        shard_jobs[shard] += 1
        shard_work[shard] += work
        done_at[shard] = max(done_at[shard], now) + work
        hit_tokens += cached * block_size
        ideal_tokens += ideal * block_size
        prompt_total += prompt_tokens
        if placed is not None and chain:
            window = windows[-1]
            window.hit_tokens += cached * block_size
            window.prompt_tokens += prompt_tokens
            before = window.placed_before.pop(chain[-1], None)
            if before is not None:
                window.asked_again += 1
                window.remapped += before != shard
            placed[chain[-1]] = shard
    if not jobs:
        raise WorkloadError(f"workload {workload.name!r} has no jobs")
    if pending:
        raise WorkloadError(f"fleet change at job {pending[0].at_job} is beyond the "
                            f"workload's {jobs} jobs")
    served = [work for work in shard_work if work] or [0]
    mean_work = sum(served) / len(served) if changes else sum(shard_work) / shards
    return {
        "policy": policy, "workload": workload.name, "shards": shards, "jobs": jobs,
        "block_size": block_size, "cache_blocks": cache_blocks,
        "prefill_cost": prefill_cost, "decode_cost": decode_cost, "arrival_rate": arrival_rate,
        "weight": weight, "epsilon": epsilon,
        "hit_rate": hit_tokens / prompt_total,
        "ideal_hit_rate": ideal_tokens / prompt_total,
        "shard_jobs": shard_jobs, "shard_work": shard_work,
        "load_max_over_mean": max(shard_work) / mean_work if mean_work else 1.0,
        "makespan": max(done_at),
        "router_state_entries": router.state_entries(),
        "fleet_changes": [window.report(previous.hit_rate)
                          for previous, window in pairwise(windows)],
        "seconds": time.perf_counter() - started,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `jobsvc simulate`; the routing options default to the service's settings,
    the others to this module's and WorkloadShape's defaults."""
    shape = WorkloadShape()
    parser.add_argument("--workload", required=True,
                        help=f"{', '.join(WORKLOAD_NAMES)}, or a .jsonl file of jobs "
                             "(document, question, optional max_tokens)")
    parser.add_argument("--shards", type=int, default=DEFAULT_SHARDS)
    parser.add_argument("--policy", choices=POLICY_NAMES,
                        help="routing policy (default: JOBSVC_ROUTING)")
    parser.add_argument("--json", type=Path, help="also write the report to this file")
    parser.add_argument("--cache-blocks", type=int, default=DEFAULT_CAPACITY_BLOCKS,
                        help="prefix cache capacity of each shard, in blocks")
    parser.add_argument("--block-size", type=int,
                        help="tokens per block (default: JOBSVC_BLOCK_SIZE)")
    parser.add_argument("--prefill-cost", type=int, default=DEFAULT_PREFILL_COST,
                        help="work per uncached prompt token")
    parser.add_argument("--decode-cost", type=float,
                        help="work per output token (default: JOBSVC_ROUTING_DECODE_COST)")
    parser.add_argument("--arrival-rate", type=float,
                        help="jobs per unit of work time (default: one burst at time 0)")
    parser.add_argument("--weight", type=float,
                        help="cache_aware: cost per unit of outstanding work "
                             "(default: JOBSVC_ROUTING_LOAD_WEIGHT)")
    parser.add_argument("--changes", default="",
                        help="shards joining and leaving mid-run: KIND:SHARD@JOB,... with KIND "
                             "join or leave, e.g. leave:3@250000,join:64@500000")
    parser.add_argument("--epsilon", type=float,
                        help="cache_aware: load bound slack over the mean "
                             "(default: JOBSVC_ROUTING_LOAD_SLACK)")
    generated = parser.add_argument_group("generated workloads")
    generated.add_argument("--jobs", type=int, default=shape.jobs)
    generated.add_argument("--documents", type=int, default=shape.documents)
    generated.add_argument("--blocks-per-document", type=int, default=shape.blocks_per_document)
    generated.add_argument("--question-tokens", type=int, default=shape.question_tokens)
    generated.add_argument("--output-tokens", type=int, default=shape.output_tokens,
                           help="also the default for JSONL lines without max_tokens")
    generated.add_argument("--preamble-blocks", type=int, default=shape.preamble_blocks)
    generated.add_argument("--group-size", type=int, default=shape.group_size,
                           help="shared-preamble: documents per preamble")
    generated.add_argument("--seed", type=int, default=shape.seed)


def run_from_args(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    """Build the workload the options name, run it, and write the report if asked."""
    block_size = args.block_size or settings.block_size
    if args.workload.endswith(".jsonl"):
        path = Path(args.workload)
        if not path.is_file():
            raise WorkloadError(f"workload file {path} does not exist")
        workload = load_jsonl(path, block_size=block_size, output_tokens=args.output_tokens,
                              model=settings.model)
        shape = None
    else:
        shape = WorkloadShape(
            jobs=args.jobs, documents=args.documents, blocks_per_document=args.blocks_per_document,
            block_size=block_size, question_tokens=args.question_tokens,
            output_tokens=args.output_tokens, seed=args.seed,
            preamble_blocks=args.preamble_blocks, group_size=args.group_size)
        workload = generate(args.workload, shape)
    report = run_simulation(
        workload, shards=args.shards, policy=args.policy or settings.routing,
        cache_blocks=args.cache_blocks, prefill_cost=args.prefill_cost,
        decode_cost=_or_setting(args.decode_cost, settings.routing_decode_cost),
        arrival_rate=args.arrival_rate,
        weight=_or_setting(args.weight, settings.routing_load_weight),
        epsilon=_or_setting(args.epsilon, settings.routing_load_slack),
        changes=parse_changes(args.changes))
    report["shape"] = asdict(shape) if shape else None
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _or_setting(option: float | None, setting: float) -> float:
    return setting if option is None else option
