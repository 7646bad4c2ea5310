"""A slice of a batch file's request lines, made jobs: each line checked and cut into shared
prefix + own suffix (`chat_template`), each distinct prefix tokenized once, each prompt checked
against the model (`jobsvc.validation`), and the slice submitted through
`Client.submit_prepared` under idempotency keys made from the batch and the line's custom_id,
so a slice submitted again (a server that stopped before it recorded its progress) gets the
jobs it made the first time."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jobsvc.batchapi.chat_template import ChatTemplate, SplitPrompt, split_prompt
from jobsvc.batchapi.line_requests import (
    CHAT_ENDPOINT,
    COMPLETIONS_ENDPOINT,
    EMBEDDINGS_ENDPOINT,
    RESPONSES_ENDPOINT,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    LineError,
    parse_request,
)
from jobsvc.batchapi.lines import RequestLine
from jobsvc.batchapi.responses_requests import chat_body, responses_error
from jobsvc.batchapi.tool_calls import stored_plan
from jobsvc.client import Client
from jobsvc.dispatch import PreparedJob
from jobsvc.errors import InvalidJob
from jobsvc.served_models import GENERATE, ServedModel
from jobsvc.store.batches import LineOutcome
from jobsvc.validation import ContextExceeded, JobLimits, check_prompt


def idempotency_key(batch_id: str, custom_id: str) -> str:
    """The key of the job a batch's line makes: the same for every submit of that line."""
    return f"{batch_id}:{hashlib.blake2b(custom_id.encode(), digest_size=16).hexdigest()}"


def invalid(error: LineError) -> dict[str, Any]:
    """The stored form of a line refused on its content: a 400 from its endpoint."""
    return {"status_code": 400, "error": error.to_api()}


@dataclass(frozen=True)
class _Accepted:
    request: RequestLine
    # The model the line names, as the fleet serves it.
    model: ServedModel
    split: SplitPrompt
    sampling: dict[str, Any]
    max_tokens: int | None
    # What is kept of the line's tool plan, to read its answer by (`tool_calls.stored_plan`).
    tool_plan: dict[str, Any] | None


@dataclass(frozen=True)
class PreparedSlice:
    """A slice of lines ready to submit: the job of each valid line and the error of each
    other one, by line number."""

    lines: Sequence[RequestLine]
    jobs: dict[int, PreparedJob]
    errors: dict[int, LineError]
    # The tool plan each chat line's answer is read by (`tool_calls.stored_plan`).
    tool_plans: dict[int, dict[str, Any] | None]


class Ingestor:
    """Turns slices of a batch's request lines into jobs, with everything a line needs checked first
    so that a bad line fails alone instead of taking its slice down."""

    def __init__(self, client: Client, *, limits: JobLimits) -> None:
        self._client = client
        self._limits = limits
        # Each model's chat template, by the weights it comes with, read once.
        self._templates: dict[str, ChatTemplate] = {}

    @property
    def context_length(self) -> int:
        """The longest context of the fleet's models, in tokens: what a line's prompt and its
        answer may fill at most. Workers register their context, so no model's configuration
        is read for it (the settings' own model stands in before any registered)."""
        return max(model.context or self._client.models.prompts(model).context_length
                   for model in self._client.models.models().values())

    def _template(self, model: ServedModel) -> ChatTemplate:
        if model.weights not in self._templates:
            self._templates[model.weights] = ChatTemplate(model.weights)
        return self._templates[model.weights]

    def ingest(self, batch_id: str, endpoint: str, lines: Sequence[RequestLine]
               ) -> list[LineOutcome]:
        """Submit the slice's valid lines as jobs; every line gets its outcome, in order."""
        return self.submit(self.prepare(batch_id, endpoint, lines))

    def prepare(self, batch_id: str, endpoint: str, lines: Sequence[RequestLine]
                ) -> PreparedSlice:
        """Everything of a slice short of submitting it: each line checked, cut and tokenized
        into its job, or refused. It records and enqueues nothing, so the next slice is
        prepared while one is submitted."""
        if endpoint == EMBEDDINGS_ENDPOINT:
            return self._prepare_embeddings(batch_id, lines)
        errors: dict[int, LineError] = {}
        accepted: list[_Accepted] = []
        for request in lines:
            if request.refused is not None:
                errors[request.line] = request.refused
                continue
            try:
                parsed = self._parse(endpoint, request.body)
                model = self._model(parsed.model)
                split = (self._template(model).split(parsed.messages, parsed.tools.tools)
                         if isinstance(parsed, ChatRequest) else split_prompt(parsed.prompt))
            except LineError as error:
                errors[request.line] = _named(endpoint, error, request.body)
                continue
            plan = stored_plan(parsed.tools) if isinstance(parsed, ChatRequest) else None
            accepted.append(_Accepted(request, model, split, parsed.sampling, parsed.max_tokens,
                                      plan))
        jobs = [job for name in dict.fromkeys(item.model.name for item in accepted)
                for job in self._prepare(batch_id, endpoint, [
                    item for item in accepted if item.model.name == name], errors)]
        return PreparedSlice(lines, {item.request.line: job for item, job in jobs}, errors,
                             {item.request.line: item.tool_plan for item, _ in jobs})

    def submit(self, prepared: PreparedSlice) -> list[LineOutcome]:
        """Submit a prepared slice's jobs; every line gets its outcome, in order."""
        job_ids = dict(zip(prepared.jobs, self._client.submit_prepared(
            list(prepared.jobs.values())), strict=True)) if prepared.jobs else {}
        errors = prepared.errors
        return [LineOutcome(request.line, request.custom_id, job_ids.get(request.line),
                            invalid(errors[request.line]) if request.line in errors else None,
                            prepared.tool_plans.get(request.line))
                for request in prepared.lines]

    def _prepare_embeddings(self, batch_id: str, lines: Sequence[RequestLine]
                            ) -> PreparedSlice:
        """An embeddings slice: each valid line one job of its inputs, checked against the
        embedding model it names (`Client.prepare_embedding`)."""
        errors: dict[int, LineError] = {}
        jobs: dict[int, PreparedJob] = {}
        for request in lines:
            if request.refused is not None:
                errors[request.line] = request.refused
                continue
            try:
                parsed = parse_request(EMBEDDINGS_ENDPOINT, request.body, limits=self._limits)
                assert isinstance(parsed, EmbeddingRequest)
                jobs[request.line] = self._client.prepare_embedding(
                    parsed.inputs, dimensions=parsed.dimensions,
                    encoding_format=parsed.encoding_format, model=parsed.model,
                    idempotency_key=idempotency_key(batch_id, request.custom_id))
            except LineError as error:
                errors[request.line] = error
            except InvalidJob as error:
                code = ("model_not_found" if error.field == "model" else
                        "context_length_exceeded" if isinstance(error, ContextExceeded)
                        else "invalid_value")
                errors[request.line] = LineError(str(error), error.field, code)
        return PreparedSlice(lines, jobs, errors, {})

    def _parse(self, endpoint: str, body: Mapping[str, Any]
               ) -> ChatRequest | CompletionRequest:
        """The request a line's body makes; a Responses body as the chat request it amounts
        to."""
        if endpoint == RESPONSES_ENDPOINT:
            endpoint, body = CHAT_ENDPOINT, chat_body(body)
        return parse_request(endpoint, body, limits=self._limits)

    def _model(self, name: str | None) -> ServedModel:
        """The served model a line names, or the line's `model_not_found` error."""
        try:
            return self._client.models.resolve(name, GENERATE)
        except InvalidJob as error:
            raise LineError(str(error), "model", "model_not_found") from None

    def _prepare(self, batch_id: str, endpoint: str, accepted: list[_Accepted],
                 errors: dict[int, LineError]) -> list[tuple[_Accepted, PreparedJob]]:
        """Tokenize one model's lines (each distinct prefix once), check each prompt against
        the model, and make the jobs."""
        model = accepted[0].model
        prompts = self._client.models.prompts(model)
        # A rendered chat carries its special tokens as text; a completions prompt gets the
        # model's leading ones, as vLLM's endpoints tokenize them.
        completions = endpoint == COMPLETIONS_ENDPOINT
        prefixes = list(dict.fromkeys(item.split.prefix for item in accepted))
        prefix_tokens = dict(zip(prefixes, prompts.encode(prefixes, special=completions),
                                 strict=True))
        suffix_tokens = prompts.encode([item.split.suffix for item in accepted], special=False)
        context, vocabulary = prompts.context_length, prompts.vocabulary_size
        prompt_field = "prompt" if completions else "messages"
        jobs = []
        for item, suffix in zip(accepted, suffix_tokens, strict=True):
            prefix = prefix_tokens[item.split.prefix]
            if not prefix or not suffix:
                # Every stored prefix and suffix holds a token: move one across the cut.
                joined = [*prefix, *suffix]
                prefix, suffix = joined[:1], joined[1:]
            prompt = len(prefix) + len(suffix)
            max_tokens = item.max_tokens if item.max_tokens is not None else context - prompt
            sampling = {**item.sampling, "max_tokens": max_tokens}
            try:
                check_prompt(prompt, sampling, context, vocabulary, prompt_field=prompt_field)
            except InvalidJob as error:
                errors[item.request.line] = _named(endpoint, LineError(
                    str(error), error.field, "context_length_exceeded"
                    if isinstance(error, ContextExceeded) else "invalid_value"),
                    item.request.body)
                continue
            jobs.append((item, PreparedJob(
                item.split.prefix, prefix, item.split.suffix, suffix, sampling,
                idempotency_key(batch_id, item.request.custom_id), model=model.name)))
        return jobs


def _named(endpoint: str, error: LineError, body: Mapping[str, Any]) -> LineError:
    """A line's error naming the fields of the line's own endpoint."""
    return responses_error(error, body) if endpoint == RESPONSES_ENDPOINT else error
