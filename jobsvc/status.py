"""`jobsvc status`: per shard, its queue, its unfinished jobs, its model and its worker, and per
model, its live workers and unfinished jobs, as text or JSON, with an exit code a health check
can use.

The exit code is 0 when every listed shard that has work (messages waiting or unfinished jobs)
has a healthy worker (alive, its engine ready) and every model that unfinished jobs ask for has
a live worker, and 1 otherwise. Asked about one shard (`--shard N`, what a worker's health
check runs), that shard's worker must be healthy whether or not work waits for it, and nothing
else counts: jobs waiting for another model are no fault of that worker's."""

from __future__ import annotations

from typing import Any

from jobsvc.fleet import Fleet, ModelView, ShardView
from jobsvc.health import SeenWorker

EXIT_HEALTHY = 0
EXIT_UNHEALTHY = 1


def needs_attention(view: ShardView, *, named: bool) -> bool:
    """A shard whose work no healthy worker takes; a shard named on its own needs a healthy
    worker even when idle."""
    return not view.healthy and (named or view.has_work)


def model_needs_attention(view: ModelView, *, named: bool) -> bool:
    """A model whose jobs wait for a worker, unless one shard's worker alone is asked about."""
    return view.waiting and not named


def exit_code(fleet: Fleet, *, named: bool = False) -> int:
    """0 when no listed shard or model needs attention, 1 otherwise: what a health check acts
    on."""
    if (any(needs_attention(view, named=named) for view in fleet.shards)
            or any(model_needs_attention(view, named=named) for view in fleet.models)):
        return EXIT_UNHEALTHY
    return EXIT_HEALTHY


def worker_report(seen: SeenWorker | None) -> dict[str, Any]:
    """A shard's worker as `jobsvc status --json` reports it."""
    if seen is None:
        return {"alive": False, "last_seen_s": None}
    beat = seen.heartbeat
    last_message = beat.last_message_finished_s
    return {
        "alive": seen.alive, "healthy": seen.healthy, "name": beat.worker, "host": beat.host,
        "pid": beat.pid, "last_seen_s": round(seen.age_s, 1), "up_s": round(beat.up_s, 1),
        "engine_ready": beat.engine_ready, "messages_in_flight": beat.messages_in_flight,
        "last_message_finished_s": (None if last_message is None
                                    else round(last_message + seen.age_s, 1)),
        "metrics_port": beat.metrics_port, "stopped": beat.stopped,
    }


def status_report(fleet: Fleet, *, named: bool = False) -> dict[str, Any]:
    """What `jobsvc status --json` prints."""
    report: dict[str, Any] = {"shards": [{
        "shard": view.shard, "configured": view.configured, "models": list(view.models),
        "queue_messages": view.queue_messages, "jobs": dict(view.jobs),
        "outstanding_load": view.outstanding_load, "worker": worker_report(view.worker),
        "needs_attention": needs_attention(view, named=named),
    } for view in fleet.shards], "models": [{
        "model": view.name, "task": view.task, "workers": view.workers, "jobs": dict(view.jobs),
        "waiting": view.waiting, "needs_attention": model_needs_attention(view, named=named),
    } for view in fleet.models]}
    if fleet.batches is not None:
        report["batches"] = dict(fleet.batches)
    return report


_SHARD_COLUMNS = ("shard", "model", "queue", "queued", "running", "load", "worker")
_MODEL_COLUMNS = ("model", "task", "workers", "queued", "running", "")


def render_text(report: dict[str, Any]) -> str:
    """A table of the report, one row per shard, then one row per model, and a last line that
    says what is wrong."""
    lines = _table(_SHARD_COLUMNS, [(
        str(shard["shard"]) + ("" if shard["configured"] else "*"),
        _describe_models(shard["models"]), str(shard["queue_messages"]),
        str(shard["jobs"]["queued"]), str(shard["jobs"]["running"]),
        "?" if shard["outstanding_load"] is None else str(shard["outstanding_load"]),
        _describe_worker(shard["worker"])) for shard in report["shards"]])
    if any(not shard["configured"] for shard in report["shards"]):
        lines.append("* live, though these settings do not name it (JOBSVC_SHARDS)")
    if report["models"]:
        lines += _table(_MODEL_COLUMNS, [(
            model["model"], model["task"] or "?", str(model["workers"]),
            str(model["jobs"]["queued"]), str(model["jobs"]["running"]),
            "jobs wait for a worker" if model["waiting"] else "")
            for model in report["models"]])
    if "batches" in report:
        lines.append("batches: " + (", ".join(f"{status} {count}" for status, count
                                             in sorted(report["batches"].items())) or "none"))
    lines.append(_verdict(report))
    return "\n".join(lines)


def _table(columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """Rows under their column names, each column as wide as its widest cell but the last."""
    rows = [columns, *rows]
    widths = [max(len(row[column]) for row in rows) for column in range(len(columns) - 1)]
    return ["  ".join([*(cell.ljust(width) for cell, width in zip(row, widths, strict=False)),
                       row[-1]]).rstrip() for row in rows]


def _verdict(report: dict[str, Any]) -> str:
    shards = [str(shard["shard"]) for shard in report["shards"] if shard["needs_attention"]]
    models = [model["model"] for model in report["models"] if model["needs_attention"]]
    faults = ([f"shard {', '.join(shards)} (work waits, no healthy worker)"] if shards else []) + (
        [f"model {', '.join(models)} (jobs wait, no live worker serves it)"] if models else [])
    if faults:
        return "needs attention: " + "; ".join(faults)
    return "ok: every shard with work has a healthy worker, every model with jobs a live one"


def _describe_models(names: list[str]) -> str:
    """A shard's model, then its adapters after a plus sign."""
    return "+".join(names) if names else "-"


def _describe_worker(worker: dict[str, Any]) -> str:
    if worker["last_seen_s"] is None:
        return "none seen"
    seen = f"seen {worker['last_seen_s']:.0f} s ago"
    if worker["stopped"]:
        return f"stopped ({worker['name']}, {seen})"
    if not worker["alive"]:
        return f"gone ({worker['name']}, {seen})"
    state = "engine ready" if worker["engine_ready"] else "engine starting"
    last = worker["last_message_finished_s"]
    return (f"alive {worker['name']} pid {worker['pid']}, {state}, "
            f"{worker['messages_in_flight']} messages in flight, last message "
            + ("none" if last is None else f"{last:.0f} s ago") + f", {seen}")
