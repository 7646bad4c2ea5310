"""The `jobsvc` command line: migrate, worker, demo, stats, status, drain, flower."""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from jobsvc.console import ProgressBar, configure_logging
from jobsvc.errors import JobsvcError
from jobsvc.routing.policies import POLICY_NAMES
from jobsvc.settings import TASKS, Settings, masked_url
from jobsvc.simulate import add_arguments as add_simulate_arguments


def _migrate(settings: Settings, _args: argparse.Namespace) -> None:
    from jobsvc.migrate import upgrade_to_head

    upgrade_to_head(settings.resolved_database_url)
    print(f"database at head: {masked_url(settings.resolved_database_url)}")


def _worker(settings: Settings, args: argparse.Namespace) -> None:
    from jobsvc.workers.bootstrap import run_worker

    if args.shard < 0:
        raise SystemExit(f"--shard must be 0 or more, got {args.shard}")
    served = {name: value for name, value in (("model", args.model),
                                              ("served_model_name", args.served_model_name),
                                              ("task", args.task)) if value is not None}
    if args.lora is not None:
        served["loras"] = ",".join(args.lora)
    if served:
        settings = replace(settings, **served)
        settings.validate()
    run_worker(settings, args.shard, args.device, args.parent_pid)


def _demo(settings: Settings, args: argparse.Namespace) -> None:
    from jobsvc.demo import run_demo

    run_demo(settings, documents=args.documents, questions=args.questions, words=args.words,
             second_model=args.second_model)


def _bench(settings: Settings, args: argparse.Namespace) -> None:
    from jobsvc.bench.options import BenchOptions
    from jobsvc.bench.run import run_bench

    # Standard output is for the JSON result; the in-process engines log to standard error.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

    options = BenchOptions(workload=args.workload, shards=args.shards, policy=args.policy,
                           trials=args.trials,
                           words=args.words, output_tokens=args.output_tokens,
                           json_path=args.json, plot_path=args.plot,
                           fresh_engines=args.fresh_engines,
                           standalone_on_workers=not args.own_standalone_engines,
                           standalone_twice=args.standalone_twice,
                           compare_admission=args.compare_admission,
                           standalone_admission=args.standalone_admission)
    with ProgressBar(options.trials, "pairs", unit="pair") as bar:
        result = run_bench(settings, options, progress=bar.write,
                           pair_done=lambda: bar.advance(1))
    summary = {key: value for key, value in result.items() if key != "pairs"}
    print(json.dumps(summary, indent=2))


def _simulate(settings: Settings, args: argparse.Namespace) -> None:
    from jobsvc.simulate import run_from_args

    print(json.dumps(run_from_args(settings, args), indent=2))


def _requeue(settings: Settings, _args: argparse.Namespace) -> None:
    import redis

    from jobsvc.reconcile import Reconciler
    from jobsvc.store import Store
    from jobsvc.transport import make_celery

    store = Store(settings.resolved_database_url)
    try:
        report = Reconciler(settings, redis.Redis.from_url(settings.redis_url), store,
                            make_celery(settings)).run_round()
    finally:
        store.dispose()
    print(f"sent {report.requeued} stranded jobs again; load corrected by shard: "
          f"{report.load_corrected}")


def _stats(settings: Settings, _args: argparse.Namespace) -> None:
    from jobsvc.store import Store

    store = Store(settings.resolved_database_url)
    print(json.dumps(store.totals(), default=str, indent=2))


def _status(settings: Settings, args: argparse.Namespace) -> None:
    import redis

    from jobsvc.errors import translated
    from jobsvc.fleet import FleetReader
    from jobsvc.status import exit_code, render_text, status_report
    from jobsvc.store import Store

    store = Store(settings.resolved_database_url)
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=10)
    try:
        with translated(f"read the queues and heartbeats in Redis at "
                        f"{masked_url(settings.redis_url)} and the unfinished jobs"):
            fleet = FleetReader(settings, client, store).read(only=args.shard)
    finally:
        store.dispose()
        client.close()
    named = args.shard is not None
    report = status_report(fleet, named=named)
    print(json.dumps(report, indent=2) if args.json else render_text(report))
    raise SystemExit(exit_code(fleet, named=named))


def _drain(settings: Settings, args: argparse.Namespace) -> None:
    from jobsvc.drain import drain_shard

    outcome = drain_shard(settings, args.shard, args.timeout,
                          lambda line: print(line, file=sys.stderr))
    if outcome.worker is None:
        print(f"shard {args.shard} has no live worker; moved {outcome.moved} queued jobs to "
              "live shards")
    elif outcome.done:
        print(f"shard {args.shard} drained: worker {outcome.worker} stopped")
    else:
        print(f"shard {args.shard}: worker {outcome.worker} still runs after {args.timeout:.0f} "
              "s; it stops once its batches end (run drain again to keep waiting)")
        raise SystemExit(1)


def _flower(settings: Settings, args: argparse.Namespace) -> None:
    from jobsvc.flower_app import run_flower

    # In this process, with this interpreter's Celery and Flower: nothing need be on PATH,
    # and the broker URL, which may hold a password, appears on no command line.
    code = run_flower(settings, args.address, open_=args.open)
    # Flower has stopped, but a call to the broker still under way in one of its executor's
    # threads (retrying a refused connection) would hold the interpreter's exit for as long
    # as it retries: the exit handlers (Flower's own stop among them) run, then the process
    # ends without joining those threads.
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve(settings: Settings, args: argparse.Namespace) -> None:
    from jobsvc.server.app import serve

    serve(settings, args.host, args.port)


def _run_batch(settings: Settings, args: argparse.Namespace) -> None:
    from jobsvc.runbatch import run_batch

    batch = run_batch(settings, args.input, args.output)
    print(f"{batch.id} {batch.status}: {batch.completed} succeeded, {batch.failed} failed; "
          f"output in {args.output}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and its options in one parser, so `jobsvc --help` lists all there is."""
    parser = argparse.ArgumentParser(prog="jobsvc", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("migrate", help="create or upgrade the database schema").set_defaults(
        run=_migrate)
    worker = commands.add_parser("worker", help="run the worker of one shard")
    worker.add_argument("--shard", type=int, required=True)
    worker.add_argument("--device", help="GPU index (GPU hosts) or CPU cores such as 0-1")
    worker.add_argument("--model", help="weights to serve: a folder or a hub name "
                        "(default JOBSVC_MODEL)")
    worker.add_argument("--served-model-name", help="the name jobs ask for it by "
                        "(default JOBSVC_SERVED_MODEL_NAME)")
    worker.add_argument("--task", choices=TASKS, help="generate answers or embed inputs "
                        "(default JOBSVC_TASK)")
    worker.add_argument("--lora", action="append", metavar="NAME=PATH",
                        help="a LoRA adapter to load and serve under NAME (repeatable; "
                        "default JOBSVC_LORAS)")
    worker.add_argument("--parent-pid", type=int, metavar="PID",
                        help="shut down when the process that started the worker, PID, ends "
                        "(how the demo, the benchmark and the tests start theirs)")
    worker.set_defaults(run=_worker)
    demo = commands.add_parser("demo", help="run the whole pipeline on this machine")
    demo.add_argument("--documents", type=int, default=8)
    demo.add_argument("--questions", type=int, default=4, help="questions per document")
    demo.add_argument("--words", type=int, default=500, help="words per document")
    demo.add_argument("--second-model", metavar="PATH_OR_NAME",
                      help="also serve these weights as a second model, on a shard of its own, "
                      "and send it every other document")
    demo.set_defaults(run=_demo)
    bench = commands.add_parser(
        "bench", help="service vs standalone vLLM in alternated pairs; JSON on stdout")
    bench.add_argument("--workload", default="reuse",
                       help="unique, reuse, zipf, structured or PATH.jsonl")
    bench.add_argument("--shards", type=int, default=1)
    bench.add_argument("--policy", choices=POLICY_NAMES,
                       help="routing policy for this run (default: JOBSVC_ROUTING)")
    bench.add_argument("--trials", type=int, default=7, help="alternated pairs")
    bench.add_argument("--words", type=int, default=520,
                       help="words per generated document (520 is about 1,500 tokens)")
    bench.add_argument("--output-tokens", type=int, default=16)
    bench.add_argument("--json", type=Path, help="write the full result here")
    bench.add_argument("--plot", type=Path, help="write a PNG of the pairs here")
    bench.add_argument("--fresh-engines", action="store_true",
                       help="start every engine afresh before each pair (engines started "
                            "alike can differ in speed for their whole life)")
    bench.add_argument("--own-standalone-engines", action="store_true",
                       help="give the standalone arm engines of its own in the bench process "
                            "(by default it drives the service workers' engines directly, so "
                            "both arms meet the same engine)")
    bench.add_argument("--standalone-twice", action="store_true",
                       help="A/A run: the standalone arm in both places of every pair, to "
                            "see the spread of ratios this host's noise alone produces")
    bench.add_argument("--compare-admission", action="store_true",
                       help="A/B run: the service admitting each message at once in the "
                            "standalone arm's place, to see what paced admission "
                            "(JOBSVC_ADMISSION_CHUNK, JOBSVC_ADMISSION_PAUSE_MS) gains or costs")
    bench.add_argument("--standalone-admission", metavar="STYLE",
                       help="fix the standalone arm's admission style, all or staggered "
                            "(default: calibrate and keep the faster)")
    bench.set_defaults(run=_bench)
    simulate = commands.add_parser(
        "simulate", help="replay a workload over simulated shards under one routing policy")
    add_simulate_arguments(simulate)
    simulate.set_defaults(run=_simulate)
    commands.add_parser(
        "requeue", help="send again the unfinished jobs whose queue messages are gone, and "
        "return load no job holds (workers do this every JOBSVC_REQUEUE_INTERVAL seconds)"
    ).set_defaults(
        run=_requeue)
    commands.add_parser("stats", help="job and token totals as JSON").set_defaults(run=_stats)
    serve = commands.add_parser(
        "serve", help="the OpenAI Files and Batch APIs over HTTP (for the openai client)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.set_defaults(run=_serve)
    run_batch = commands.add_parser(
        "run-batch", help="run an OpenAI batch file through the fleet, output as vllm "
        "run-batch writes it")
    run_batch.add_argument("-i", "--input", type=Path, required=True,
                           help="the batch file (JSONL requests)")
    run_batch.add_argument("-o", "--output", type=Path, required=True,
                           help="where to write one result line per request")
    run_batch.set_defaults(run=_run_batch)
    status = commands.add_parser(
        "status", help="per shard: queue, unfinished jobs, worker; exit code 0 when every "
        "shard with work has a healthy worker")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument("--shard", type=int,
                        help="this shard alone; exit code 0 only if its worker is healthy "
                             "(a worker's health check)")
    status.set_defaults(run=_status)
    drain = commands.add_parser(
        "drain", help="take a shard out of service: no new jobs, running batches finish, "
        "queued jobs move to live shards, then its worker exits 0")
    drain.add_argument("--shard", type=int, required=True)
    drain.add_argument("--timeout", type=float, default=600,
                       help="seconds to wait for the worker to stop (exit code 1 after)")
    drain.set_defaults(run=_drain)
    flower = commands.add_parser("flower", help="run Flower on the shard queues")
    flower.add_argument("--address", default="127.0.0.1")
    flower.add_argument("--open", action="store_true",
                        help="run without a password (FLOWER_BASIC_AUTH unset), on a loopback "
                             "address only")
    flower.set_defaults(run=_flower)
    return parser


# Commands that handle SIGTERM themselves: Celery's worker, uvicorn, Flower.
_OWN_SIGTERM = frozenset({"worker", "serve", "flower"})


class _Terminated(KeyboardInterrupt):
    """SIGTERM (as `timeout`, a supervisor or `kill` send it) unwinds like Ctrl-C, so the
    with-blocks of `demo` and `bench` stop the workers and engines they started."""


def _terminated(_signum: int, _frame: object) -> None:
    raise _Terminated


def main(argv: Sequence[str] | None = None) -> None:
    """The `jobsvc` entry point: settings read once, errors as one line and exit status 2, Ctrl-C
    and SIGTERM as a clean stop without a traceback."""
    args = build_parser().parse_args(argv)
    if args.command not in _OWN_SIGTERM:
        signal.signal(signal.SIGTERM, _terminated)
    try:
        settings = Settings.from_env()
        configure_logging(settings.log_level, explicit="JOBSVC_LOG_LEVEL" in os.environ,
                          worker=args.command == "worker")
        args.run(settings, args)
    except JobsvcError as error:
        print(f"jobsvc: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt as stop:
        # The with-blocks on the way here stopped what the command started: no traceback.
        terminated = isinstance(stop, _Terminated)
        print(f"\njobsvc: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        raise SystemExit(128 + (signal.SIGTERM if terminated else signal.SIGINT)) from None
