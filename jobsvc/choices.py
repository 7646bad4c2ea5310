"""What an answer holds beyond its text, for a job that asks for it: several choices (`n`) and
the log probability of each generated token with the most likely alternatives; and, for an
answer a stop string (or stop token) ended, which one did. The worker stores it as one
compressed JSON frame beside the answer's text (which stays the first choice's), and the
renderer and the Python API read it back as typed values. Any other answer stores nothing more
than its text.
Pure: typed values in, bytes out, and back."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jobsvc import compression

# What a log probability of minus infinity (a token the constraint or a bias rules out) is
# written as: JSON has no infinity, and OpenAI's endpoints write this value.
LOWEST_LOGPROB = -9999.0
_VERSION = 1


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its text, its log probability, and the most likely tokens at its
    step, most likely first (as many as the job asked for; the token itself may be among
    them)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Choice:
    """One of a job's answers: its text, why it ended, its tokens, and their log
    probabilities when the job asked for them."""

    text: str
    finish_reason: str | None
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] | None = None
    # The stop string, or the stop token's ID, that ended the answer (the engine's own
    # `stop_reason`); None when something else did (its end-of-text token, its limit).
    stop_reason: str | int | None = None


def finite(logprob: float) -> float:
    """A log probability as it is stored: minus infinity (and NaN) as LOWEST_LOGPROB."""
    return logprob if math.isfinite(logprob) else LOWEST_LOGPROB


def encode_choices(choices: Sequence[Choice]) -> bytes:
    """The choices as one zstd frame of versioned JSON."""
    return compression.compress(json.dumps(
        {"v": _VERSION, "choices": [_choice_json(choice) for choice in choices]},
        ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode())


def decode_choices(frame: bytes) -> tuple[Choice, ...]:
    """The choices an `encode_choices` frame holds."""
    data = json.loads(compression.decompress(frame))
    if data.get("v") != _VERSION:
        raise ValueError(f"unknown choices frame version {data.get('v')!r}")
    return tuple(Choice(item["text"], item["finish_reason"], item["tokens"],
                        None if item["logprobs"] is None else tuple(
                            TokenLogprob(token, logprob, tuple((alt, lp) for alt, lp in top))
                            for token, logprob, top in item["logprobs"]),
                        item["stop_reason"])
                 for item in data["choices"])


def stored_choices(text: str, finish_reason: str | None, completion_tokens: int,
                   frame: bytes | None) -> tuple[Choice, ...]:
    """A stored answer's choices: those of its frame, else the one its text makes, with no stop
    reason (an answer recorded with one has a frame)."""
    if frame is not None:
        return decode_choices(frame)
    return (Choice(text, finish_reason, completion_tokens),)


def _choice_json(choice: Choice) -> dict[str, Any]:
    return {"text": choice.text, "finish_reason": choice.finish_reason,
            "tokens": choice.completion_tokens, "stop_reason": choice.stop_reason,
            "logprobs": None if choice.logprobs is None else [
                [step.token, finite(step.logprob), [[alt, finite(lp)] for alt, lp in step.top]]
                for step in choice.logprobs]}
