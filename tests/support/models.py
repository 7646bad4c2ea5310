"""Models made for tests from the tiny Llama, with the project's tokenizer: one of another
shape, so that one fleet serves two generative models that are really different, and one
whose configuration makes it a Matryoshka model (its embeddings may be cut)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from jobsvc.settings import TINY_MODEL


def tiny_variant(folder: Path, **config: Any) -> Path:
    """The tiny model with these configuration values changed, written to `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(TINY_MODEL / name, folder / name)
    merged = {**json.loads((TINY_MODEL / "config.json").read_text()), **config}
    (folder / "config.json").write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
    return folder
