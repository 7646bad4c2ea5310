"""A bounded cache of what was made lately (a document's tokens, a conversation's render),
least recently used out first, its bound a total size the caller measures (characters):
producers and the batch server meet one document many times in a short while."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Recent(Generic[K, V]):
    """Values by key, holding at most `most` of what `size` measures of each key and value;
    safe to share between threads."""

    def __init__(self, most: int, size: Callable[[K, V], int]) -> None:
        self._most = most
        self._size = size
        self._held = 0
        self._values: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The value kept under `key`, now the most recently used; None if none is."""
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def keep(self, key: K, value: V) -> None:
        """Keep `value` under `key` (a value larger than the whole bound is not kept), letting
        the least recently used go to stay within the bound."""
        size = self._size(key, value)
        if size > self._most:
            return
        with self._lock:
            if key in self._values:
                return
            self._values[key] = value
            self._held += size
            while self._held > self._most:
                self._held -= self._size(*self._values.popitem(last=False))
