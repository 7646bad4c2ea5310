"""From a request to the two parts of a job's prompt: a prefix that other requests share (a
document asked several questions), stored, tokenized and routed once, and the request's own
suffix.

A chat request is rendered with the served model's chat template, as vLLM's chat endpoint
renders it; a completions request is its prompt. The cut is the last paragraph break
("\\n\\n") inside the last message (or the prompt), else the start of the last message:
`document` + `question` in one user message, the document in a system message or in an
earlier user message all put the document in the prefix. The cut depends on the request
alone, so requests on one document agree on it wherever they sit in the file. A request that
breaks a paragraph inside its question gets a prefix of its own: it still runs, and the
engine's cache still finds the document's blocks, only it is stored and routed alone.
The tools a chat request offers are the template's to render, as vLLM gives them to it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from jobsvc.batchapi.line_requests import LineError
from jobsvc.recent import Recent

PARAGRAPH_BREAK = "\n\n"
# Stands in for the last message's content, to find where the template puts it.
_MARK = "\x00jobsvc-last-message\x00"
# Characters of conversations (and what the template writes around their last message) kept
# of those rendered lately: a file asks each document its questions close together.
_RECENT_CHARS = 1 << 20


@dataclass(frozen=True)
class SplitPrompt:
    """A prompt cut in two: the prefix shared with other requests (routed and cached as one) and the
    request's own suffix."""

    prefix: str
    suffix: str


def split_prompt(prompt: str) -> SplitPrompt:
    """A completions prompt cut before its last paragraph break (all suffix without one)."""
    cut = prompt.rfind(PARAGRAPH_BREAK)
    cut = max(cut, 0)
    return SplitPrompt(prompt[:cut], prompt[cut:])


class ChatTemplate:
    """The served model's chat template (from `chat_template.jinja` or `tokenizer_config.json`
    in its folder, else through transformers), rendered in a sandbox as transformers does."""

    def __init__(self, model: str) -> None:
        self._model = model
        self._recent: Recent[str, tuple[str, str, str]] = Recent(
            _RECENT_CHARS, lambda key, parts: len(key) + sum(map(len, parts)))

    @cached_property
    def _template(self) -> tuple[Any, dict[str, str]] | None:
        source, config = self._source()
        if source is None:
            return None
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=[loopcontrols])
        # Templates write tools and call arguments with `tojson` as transformers defines it:
        # keys in their order and text unescaped (jinja's own sorts keys and escapes HTML).
        environment.filters["tojson"] = _tojson
        tokens = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}
        return environment.from_string(source), tokens

    def _source(self) -> tuple[str | None, dict[str, Any]]:
        folder = Path(self._model)
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template_file = folder / "chat_template.jinja"
        if template_file.is_file():
            return template_file.read_text(), config
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {item.get("name"): item.get("template") for item in template}
            template = named.get("default")
        if template is None and not folder.is_dir():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self._model)
            template = tokenizer.chat_template
            config = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
        return template, config

    def render(self, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text of a conversation, ending with the assistant's turn opened; the
        `tools` the model may call are the template's to show (None: none)."""
        if self._template is None:
            raise LineError(f"the served model ({self._model}) has no chat template; use the "
                            "/v1/completions endpoint", "messages", "unsupported_value")
        template, tokens = self._template
        try:
            return template.render(messages=messages, tools=tools, add_generation_prompt=True,
                                   **tokens)
        except Exception as error:
            raise LineError(f"the model's chat template refused the messages: {error}",
                            "messages") from None

    def split(self, messages: list[dict[str, Any]],
              tools: list[dict[str, Any]] | None = None) -> SplitPrompt:
        """The rendered conversation, cut as the module says."""
        full = self.render(messages, tools)
        last = messages[-1]["content"]
        before, found, after = self._marked(messages, tools)
        if not found or not full.startswith(before):
            return SplitPrompt("", full)
        cut = len(before)
        if full == before + last + after:
            cut += max(last.rfind(PARAGRAPH_BREAK), 0)
        return SplitPrompt(full[:cut], full[cut:])

    def _marked(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                ) -> tuple[str, str, str]:
        """The conversation rendered with the mark for its last message's content, cut at the
        mark. Every question on a conversation renders it alike, so it is rendered once for
        the conversations seen lately."""
        last = {name: value for name, value in messages[-1].items() if name != "content"}
        key = json.dumps([messages[:-1], last, tools], ensure_ascii=False)
        if (parts := self._recent.get(key)) is None:
            parts = self.render([*messages[:-1], {**last, "content": _MARK}], tools
                                ).partition(_MARK)
            self._recent.keep(key, parts)
        return parts


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _token_text(token: Any) -> str:
    """A special token as tokenizer_config.json gives it: a string or an AddedToken dict."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token or ""
