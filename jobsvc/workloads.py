"""Synthetic, seeded document-question workloads for the demo, benchmarks and simulations.

Text is built from a fixed pseudo-word lexicon so that the same seed gives the same bytes on
every machine; the tiny model's tokenizer is trained on the same generator.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
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
    return f"{rng.choice(QUESTION_STARTS)} {rng.choice(_LEXICON)} and {rng.choice(_LEXICON)}?"


@dataclass(frozen=True)
class WorkloadJob:
    document: str
    question: str


def document_questions(documents: int, questions_per_document: int, words_per_document: int,
                       seed: int = 0) -> list[WorkloadJob]:
    """`documents` x `questions_per_document` jobs, questions interleaved across documents
    the way independent users would send them (round by round, not document by document)."""
    rng = random.Random(seed)
    docs = [document(rng, words_per_document) for _ in range(documents)]
    return [WorkloadJob(doc, question(rng))
            for _ in range(questions_per_document) for doc in docs]


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
