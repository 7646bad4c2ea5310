"""Turn a document and a question into the engine's prompt tokens, with the served model's
tokenizer. Documents are tokenized once each (in a batch), questions on their own, so the
document's tokens form an exact prefix that the engine's prefix cache can reuse."""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from jobsvc.errors import ConfigurationError
from jobsvc.recent import Recent
from jobsvc.settings import TINY_MODEL

QUESTION_TEMPLATE = "\n\nQuestion: {question}\nAnswer:"
# Characters of recently tokenized documents a producer keeps the tokens of (a few tens of MB).
_RECENT_DOCUMENT_CHARS = 4_000_000


class PromptBuilder:
    """Tokenizes prompts with the served model's tokenizer, as the engine would, so the router and
    the prefix cache see the very tokens the engine runs."""

    def __init__(self, model: str, max_model_len: int = 0) -> None:
        if Path(model) == TINY_MODEL and not TINY_MODEL.is_dir():
            # Said here, where producers and workers first need the model, before vLLM would
            # take the missing folder for a model name to download.
            raise ConfigurationError(
                f"no model at {model}, the default JOBSVC_MODEL: the tiny test model comes "
                "with a checkout of the repository (ops/tiny-llama), not with the installed "
                "package; set JOBSVC_MODEL to a model folder or a Hugging Face model name")
        self._model = model
        self._max_model_len = max_model_len

    @cached_property
    def _tokenizer(self) -> Any:
        tokenizer_file = Path(self._model) / "tokenizer.json"
        if tokenizer_file.is_file():
            from tokenizers import Tokenizer

            return _FastTokenizer(Tokenizer.from_file(str(tokenizer_file)))
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigurationError(
                f"model {self._model!r} has no tokenizer.json; install transformers "
                "(it comes with vllm) to load its tokenizer") from None
        return _HuggingFaceTokenizer(AutoTokenizer.from_pretrained(self._model))

    @cached_property
    def _config(self) -> dict[str, Any]:
        config_file = Path(self._model) / "config.json"
        if config_file.is_file():
            return dict(json.loads(config_file.read_text()))
        from transformers import AutoConfig

        return dict(AutoConfig.from_pretrained(self._model).to_dict())

    @cached_property
    def vocabulary_size(self) -> int:
        """How many tokens the model's output layer scores: a logit bias names only these."""
        size = self._config.get("vocab_size")
        if not size:
            raise ConfigurationError(f"cannot tell the vocabulary size of {self._model!r}")
        return int(size)

    @cached_property
    def context_length(self) -> int:
        """Longest prompt plus answer the engine accepts (JOBSVC_MAX_MODEL_LEN or the model's)."""
        if self._max_model_len:
            return self._max_model_len
        config = self._config
        length = config.get("max_position_embeddings") or config.get("max_seq_len")
        if not length:
            raise ConfigurationError(
                f"cannot tell the context length of {self._model!r}; set JOBSVC_MAX_MODEL_LEN")
        return int(length)

    @cached_property
    def matryoshka(self) -> Sequence[int] | None:
        """The dimensions an embedding model can cut its vectors to, as its configuration
        says, where vLLM reads it: the `matryoshka_dimensions` listed, else every size up to
        the vectors' own for a model marked `is_matryoshka`; None for a model that is no
        Matryoshka model (the engine refuses `dimensions` on it)."""
        config = self._config
        if listed := config.get("matryoshka_dimensions"):
            return [int(size) for size in listed]
        if config.get("is_matryoshka"):
            size = config.get("embedding_size") or config.get("hidden_size")
            return range(1, int(size) + 1) if size else None
        return None

    def encode(self, texts: Sequence[str], *, special: bool) -> list[list[int]]:
        """Token IDs of each text as it is, with the model's leading special tokens or not."""
        return self._tokenizer.encode_many(list(texts), special=special)

    def documents(self, texts: Sequence[str]) -> list[list[int]]:
        """Token IDs of each document, with the model's leading special tokens. Documents are
        asked many questions: those tokenized lately are taken from a bounded cache, the same
        list each time, which callers never change."""
        known = {text: tokens for text in texts
                 if (tokens := self._documents.get(text)) is not None}
        new = list(dict.fromkeys(text for text in texts if text not in known))
        if new:
            for text, tokens in zip(new, self._tokenizer.encode_many(new, special=True),
                                    strict=True):
                self._documents.keep(text, tokens)
                known[text] = tokens
        return [known[text] for text in texts]

    @cached_property
    def _documents(self) -> Recent[str, list[int]]:
        return Recent(_RECENT_DOCUMENT_CHARS, lambda text, _tokens: len(text))

    def questions(self, texts: Sequence[str]) -> list[list[int]]:
        """Token IDs of each question's tail of the prompt, without special tokens."""
        return self._tokenizer.encode_many(
            [QUESTION_TEMPLATE.format(question=text) for text in texts], special=False)


class _FastTokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode_many(self, texts: list[str], *, special: bool) -> list[list[int]]:
        # The fast batch skips character offsets, which nothing here reads: the same IDs for
        # about two thirds of the CPU.
        return [encoding.ids for encoding in
                self._tokenizer.encode_batch_fast(texts, add_special_tokens=special)]


class _HuggingFaceTokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode_many(self, texts: list[str], *, special: bool) -> list[list[int]]:
        return self._tokenizer(texts, add_special_tokens=special)["input_ids"]
