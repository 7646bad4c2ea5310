"""Write the uneven-popularity benchmark workload (`jobsvc bench --workload
ops/workloads/uneven.jsonl`) and print its shape, with prompt lengths measured by the tiny
model's tokenizer, so a change to the generator that moves them out of range shows at once.
Running it again reproduces the file byte for byte.

    python ops/build_uneven_workload.py [OUTPUT]
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from pathlib import Path

from jobsvc.prompts import PromptBuilder
from jobsvc.settings import TINY_MODEL
from jobsvc.workloads import uneven_jobs, write_jsonl_jobs


def build(output: Path) -> dict[str, object]:
    jobs = uneven_jobs()
    write_jsonl_jobs(output, jobs)
    popularity = Counter(job.document for job in jobs)
    prompts = PromptBuilder(str(TINY_MODEL))
    lengths = dict(zip(popularity, map(len, prompts.documents(list(popularity))), strict=True))
    question_tokens = map(len, prompts.questions([job.question for job in jobs]))
    return {
        "file": str(output),
        "bytes": output.stat().st_size,
        "jobs": len(jobs),
        "documents": len(popularity),
        "questions_of_top_documents": [count for _, count in popularity.most_common(5)],
        "documents_asked_once_or_twice": sum(count <= 2 for count in popularity.values()),
        "document_tokens": {"min": min(lengths.values()),
                            "median": statistics.median(lengths.values()),
                            "max": max(lengths.values())},
        "longest_prompt_tokens": max(lengths[job.document] + tail
                                     for job, tail in zip(jobs, question_tokens, strict=True)),
        "context_tokens": prompts.context_length,
    }


if __name__ == "__main__":
    default = Path(__file__).parent / "workloads" / "uneven.jsonl"
    print(json.dumps(build(Path(sys.argv[1]) if len(sys.argv) > 1 else default), indent=2))
