"""Turns at the engine: messages share it, a group of suspects has it alone.

A suspect is a job whose earlier delivery died with its engine. Whichever job of that engine
killed it, suspects run in groups with nothing else in the engine, and a group that kills it
runs again in halves (see `suspect_groups`): innocents finish in few, large groups while the
culprit's group shrinks until it runs alone and is the one to blame, so no job is failed for
the company it kept. A group waiting for its turn keeps new messages out, so it is not starved
by a steady stream of them."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class SuspectGroup:
    """Suspects that run together with nothing else in the engine, and the isolation level
    they are charged to before they run: should the engine die now, their next delivery finds
    them there, in smaller groups."""

    job_ids: tuple[str, ...]
    charged_level: int

    @property
    def solo(self) -> bool:
        """A group of one: if the engine dies now, this job killed it."""
        return len(self.job_ids) == 1


def group_limit(level: int, batch_size: int) -> int:
    """The most suspects of one message that run together at this isolation level: a full
    message at level 0, half as many at each level above."""
    return max(1, batch_size >> level)


def suspect_groups(suspects: Sequence[tuple[str, int]], batch_size: int) -> list[SuspectGroup]:
    """Split a message's suspects, (job ID, isolation level) in the message's order, into the
    groups they run in, one after the other. Only suspects of one level share a group, so
    that no group is larger than each of its members' level allows. Lower levels run first:
    their groups are larger and less suspected, so most innocents finish before the engine
    may die again. Within a level, groups keep the message's order, which keeps a document's
    questions together."""
    by_level: dict[int, list[str]] = {}
    for job_id, level in suspects:
        by_level.setdefault(level, []).append(job_id)
    groups: list[SuspectGroup] = []
    for level in sorted(by_level):
        members, limit = by_level[level], group_limit(level, batch_size)
        for start in range(0, len(members), limit):
            group = tuple(members[start:start + limit])
            groups.append(SuspectGroup(group, _charged_level(level, len(group), batch_size)))
    return groups


def _charged_level(level: int, size: int, batch_size: int) -> int:
    """The level a group of `size` at `level` is charged to: the next one, or further while
    that one's groups would still hold this whole group (a message with fewer suspects than
    the level allows), so that each death of the engine splits the group that died."""
    charged = level + 1
    while size > 1 and group_limit(charged, batch_size) >= size:
        charged += 1
    return charged


class EngineTurns:
    """Gives the engine to messages together or to one suspect group alone, so a job that kills the
    engine takes no innocent job down with it."""

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._sharing = 0
        self._alone = False
        self._waiting_alone = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        """Run a message beside other messages, unless a suspect group has or waits for the
        engine."""
        with self._changed:
            self._changed.wait_for(lambda: not self._alone and not self._waiting_alone)
            self._sharing += 1
        try:
            yield
        finally:
            with self._changed:
                self._sharing -= 1
                self._changed.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        """Run one group of suspects with nothing else in the engine."""
        with self._changed:
            self._waiting_alone += 1
            self._changed.wait_for(lambda: not self._alone and not self._sharing)
            self._waiting_alone -= 1
            self._alone = True
        try:
            yield
        finally:
            with self._changed:
                self._alone = False
                self._changed.notify_all()
