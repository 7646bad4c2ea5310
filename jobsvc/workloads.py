"""Synthetic, seeded document-question workloads for the demo, benchmarks and simulations.

Text is built from a fixed pseudo-word lexicon so that the same seed gives the same bytes on
every machine; the tiny model's tokenizer is trained on the same generator.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from jobsvc.errors import InvalidJob

_ONSETS = ("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "io", "ou")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "rk")

QUESTION_STARTS = ("What does the text say about", "Summarise the part on", "Who mentions",
                   "Why is there talk of", "How often does the text name", "Where does it discuss")


def lexicon(size: int = 3000, seed: int = 7) -> list[str]:
    """A deterministic list of distinct pronounceable pseudo-words."""
    rng = random.Random(seed)
    words: dict[str, None] = {}
    while len(words) < size:
        syllables = rng.choice((1, 2, 2, 3, 3, 4))
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                       for _ in range(syllables))
        words.setdefault(word, None)
    return list(words)


_LEXICON = lexicon()


def document(rng: random.Random, words: int) -> str:
    """A document of about `words` pseudo-words in sentences and paragraphs."""
    parts: list[str] = []
    written = 0
    while written < words:
        length = rng.randint(6, 18)
        sentence = " ".join(rng.choice(_LEXICON) for _ in range(length))
        parts.append(sentence[0].upper() + sentence[1:] + ".")
        written += length
        if rng.random() < 0.15:
            parts.append("\n\n")
    return " ".join(parts).replace(" \n\n ", "\n\n")


def question(rng: random.Random) -> str:
    """A seeded question about two words of the lexicon."""
    return f"{rng.choice(QUESTION_STARTS)} {rng.choice(_LEXICON)} and {rng.choice(_LEXICON)}?"


@dataclass(frozen=True)
class WorkloadJob:
    """One generated job: a document and a question about it."""

    document: str
    question: str


def document_questions(documents: int, questions_per_document: int, words_per_document: int,
                       seed: int = 0) -> list[WorkloadJob]:
    """`documents` x `questions_per_document` jobs, questions interleaved across documents
    the way independent users would send them: round by round, one question per document in
    each round, every round in its own order (a fixed order would let round robin over a shard
    count that divides `documents` keep each document on one shard by accident)."""
    rng = random.Random(seed)
    docs = [document(rng, words_per_document) for _ in range(documents)]
    jobs: list[WorkloadJob] = []
    for _ in range(questions_per_document):
        round_jobs = [WorkloadJob(doc, question(rng)) for doc in docs]
        rng.shuffle(round_jobs)
        jobs += round_jobs
    return jobs


def popularity_counts(jobs: int, documents: int, exponent: float = 1.1) -> list[int]:
    """Questions per document, most asked first: one each, the rest shared out in proportion to
    1 / rank ** exponent (Zipf, largest remainders), so that a few documents draw most of the
    reuse while most are asked once or twice, as with real users."""
    if not 1 <= documents <= jobs:
        raise ValueError(f"need 1 <= documents <= jobs, got {documents} documents for "
                         f"{jobs} jobs; lower the document count")
    weights = [rank ** -exponent for rank in range(1, documents + 1)]
    total = sum(weights)
    shares = [(jobs - documents) * weight / total for weight in weights]
    counts = [1 + int(share) for share in shares]
    by_remainder = sorted(range(documents), key=lambda rank: int(shares[rank]) - shares[rank])
    for rank in by_remainder[:jobs - sum(counts)]:
        counts[rank] += 1
    return counts


def uneven_jobs(jobs: int = 256, documents: int = 96, words: tuple[int, int] = (110, 820),
                exponent: float = 1.1, seed: int = 0) -> list[WorkloadJob]:
    """Jobs on documents of uneven popularity (`popularity_counts`) and uneven length (uniform
    in `words`; about 300-2,500 tokens of the tiny tokenizer by default), shuffled so each
    document's questions arrive spread over the burst. Hot documents and mixed prompt sizes
    are what routing and caching meet in practice, and the even `reuse` burst never shows."""
    shortest, longest = words
    if not 1 <= shortest <= longest:
        raise ValueError(f"need 1 <= shortest <= longest words per document, got {words}")
    rng = random.Random(seed)
    counts = popularity_counts(jobs, documents, exponent)
    texts = [document(rng, rng.randint(shortest, longest)) for _ in counts]
    order = [text for text, count in zip(texts, counts, strict=True) for _ in range(count)]
    rng.shuffle(order)
    return [WorkloadJob(text, question(rng)) for text in order]


def training_corpus(paragraphs: int, seed: int = 1234) -> Iterator[str]:
    """Text the tiny tokenizer is trained on: documents and questions from the same lexicon."""
    rng = random.Random(seed)
    for _ in range(paragraphs):
        yield document(rng, rng.randint(40, 200))
        yield question(rng)


def read_jsonl_jobs(path: Path) -> list[dict[str, Any]]:
    """Jobs from a JSONL file, one mapping per line with at least a document and a question."""
    jobs = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        job = json.loads(line)
        if not isinstance(job, dict) or "document" not in job or "question" not in job:
            raise InvalidJob(f"{path}:{number}: each line needs a document and a question")
        jobs.append(job)
    return jobs


def write_jsonl_jobs(path: Path, jobs: Iterable[WorkloadJob]) -> None:
    """The file `read_jsonl_jobs` reads, so a generated workload can be kept and replayed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(asdict(job)) + "\n" for job in jobs))
