"""What every part of the store works on: the engine, its dialect, a connection for reads
outside transactions, and the reading of documents that claims and moves both need."""

from __future__ import annotations

import logging

from sqlalchemy import select
from sqlalchemy.engine import Connection

from jobsvc import compression
from jobsvc.store.dialect import dialect_of, make_engine
from jobsvc.store.tables import Document

log = logging.getLogger(__name__)


def readable_tokens(label: str, tokens_zst: bytes | None) -> tuple[int, ...] | None:
    """The tokens, or None where there are none or they do not read back (logged under
    `label`, e.g. "document <key>": the caller then uses the text instead)."""
    if tokens_zst is None:
        return None
    try:
        return compression.unpack_tokens(tokens_zst)
    except compression.TokenFrameError as error:
        log.warning("%s: %s; its text is used instead", label, error)
        return None


def _readable_text(key: str, text_zst: bytes) -> str | None:
    try:
        return compression.decompress_text(text_zst)
    except compression.TextFrameError as error:
        log.warning("document %s: %s", key, error)
        return None


class Database:
    """The base of the store's parts: one engine and dialect they all share."""

    def __init__(self, database_url: str) -> None:
        self.engine = make_engine(database_url)
        self._sql = dialect_of(self.engine)
        # Single-statement reads run outside a transaction: with none to open and roll back,
        # a waiting producer's check of its jobs takes 2 round trips to PostgreSQL, not 4.
        self._reads = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        # Built once, as a worker reads documents for every message: building and keying a
        # statement cost more of its CPU than sending it.
        self._document_tokens = select(Document.key, Document.tokens_zst).where(
            self._sql.among_listed(Document.key, "keys"))
        self._document_texts = select(Document.key, Document.text_zst).where(
            self._sql.among_listed(Document.key, "keys"))

    def dispose(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()

    def _documents(self, connection: Connection, keys: set[str]
                   ) -> dict[str, tuple[int, ...] | str | None]:
        """Each document's tokens, else its text, else None; its text only where needed."""
        if not keys:
            return {}
        documents: dict[str, tuple[int, ...] | str | None] = {}
        for key, tokens_zst in connection.execute(self._document_tokens, {"keys": list(keys)}):
            tokens = readable_tokens(f"document {key}", tokens_zst)
            if tokens is not None:
                documents[key] = tokens
        untokenized = list(keys - documents.keys())
        if untokenized:
            for key, text_zst in connection.execute(self._document_texts,
                                                    {"keys": untokenized}):
                documents[key] = _readable_text(key, text_zst)
        return documents
