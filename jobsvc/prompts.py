"""Turn a document and a question into the engine's prompt tokens, with the served model's
tokenizer. Documents are tokenized once each (in a batch), questions on their own, so the
document's tokens form an exact prefix that the engine's prefix cache can reuse."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from jobsvc.errors import ConfigurationError
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
        return self._documents.tokens(texts, lambda new: self._tokenizer.encode_many(
            new, special=True))

    @cached_property
    def _documents(self) -> _RecentDocuments:
        return _RecentDocuments(_RECENT_DOCUMENT_CHARS)

    def questions(self, texts: Sequence[str]) -> list[list[int]]:
        """Token IDs of each question's tail of the prompt, without special tokens."""
        return self._tokenizer.encode_many(
            [QUESTION_TEMPLATE.format(question=text) for text in texts], special=False)


class _RecentDocuments:
    """Token IDs of the documents tokenized lately, least recently used out first, holding at
    most `most_chars` characters of documents (their tokens take a few times as many bytes)."""

    def __init__(self, most_chars: int) -> None:
        self._most_chars = most_chars
        self._chars = 0
        self._tokens: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def tokens(self, texts: Sequence[str],
               encode: Callable[[list[str]], list[list[int]]]) -> list[list[int]]:
        with self._lock:
            known = {text: self._touch(text) for text in texts if text in self._tokens}
        new = list(dict.fromkeys(text for text in texts if text not in known))
        if new:
            encoded = dict(zip(new, encode(new), strict=True))
            with self._lock:
                for text, ids in encoded.items():
                    self._keep(text, ids)
            known.update(encoded)
        return [known[text] for text in texts]

    def _touch(self, text: str) -> list[int]:
        self._tokens.move_to_end(text)
        return self._tokens[text]

    def _keep(self, text: str, ids: list[int]) -> None:
        if text in self._tokens or len(text) > self._most_chars:
            return
        self._tokens[text] = ids
        self._chars += len(text)
        while self._chars > self._most_chars:
            dropped, _ = self._tokens.popitem(last=False)
            self._chars -= len(dropped)


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
