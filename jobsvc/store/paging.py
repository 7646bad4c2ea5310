"""Paged lists of the API (files, batches): ordered by creation time, the ID breaking ties,
and continued after the object whose ID the client passes as `after`."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Select, and_, or_, select
from sqlalchemy.engine import Connection, Row


def page_rows(connection: Connection, query: Select[Any], created_at: Any, row_id: Any, *,
              after: str | None, limit: int, ascending: bool) -> tuple[list[Row[Any]], bool]:
    """Up to `limit` rows of `query` after the row `after` (an unknown ID starts from the
    top), and whether more follow."""
    if after is not None:
        anchor = connection.execute(select(created_at).where(row_id == after)
                                    ).scalar_one_or_none()
        if anchor is not None:
            later = (or_(created_at > anchor, and_(created_at == anchor, row_id > after))
                     if ascending else
                     or_(created_at < anchor, and_(created_at == anchor, row_id < after)))
            query = query.where(later)
    order = ((created_at.asc(), row_id.asc()) if ascending
             else (created_at.desc(), row_id.desc()))
    rows = connection.execute(query.order_by(*order).limit(limit + 1)).all()
    return list(rows[:limit]), len(rows) > limit
