"""A session's conversation as the client sees it: its items, in order, for
`previous_item_id`, `conversation.item.retrieve` and the item events.

Items are appended only: the model's context is the session's KV, which is written in order,
so an item can only join at the end (`previous_item_id` null, the last item, or `root` while
the conversation is empty). The last
`MAX_ITEMS` items are kept for retrieval (a real-time session is unbounded in length; its
KV bound keeps the model's context bounded, and this keeps the server's record of it bounded
too); an older item is `item_not_found`, as one that never existed.
"""

from __future__ import annotations

from collections import OrderedDict

from metronome.serve.protocol import ClientError, ErrorCode
from metronome.serve.protocol import server as se

MAX_ITEMS = 256
ROOT = "root"  # OpenAI's `previous_item_id` for the start of the conversation


class Conversation:
    def __init__(self, max_items: int = MAX_ITEMS) -> None:
        self._items: OrderedDict[str, se.ItemOut] = OrderedDict()
        self._max_items = max_items
        self.last_item_id: str | None = None  # never forgotten: the next item's previous

    def check_append(self, previous_item_id: str | None, item_id: str | None) -> None:
        """Raise `ClientError` unless an item may join here: at the end, with a new id."""
        if item_id is not None and item_id in self._items:
            raise ClientError(ErrorCode.INVALID_VALUE, f"item id {item_id!r} is already in the "
                              "conversation", "item.id")
        if previous_item_id == ROOT and self.last_item_id is None:
            return  # the start of an empty conversation is its end
        if previous_item_id is not None and previous_item_id != self.last_item_id:
            raise ClientError(ErrorCode.UNSUPPORTED, "items join the conversation at its end "
                              "only (the model's context is written in order): set "
                              f"previous_item_id to null or to the last item "
                              f"({self.last_item_id!r})", "previous_item_id")

    def add(self, item: se.ItemOut) -> str | None:
        """Append `item`; returns the item it follows (its `previous_item_id`)."""
        assert item.id not in self._items, item.id
        previous = self.last_item_id
        self._items[item.id] = item
        self.last_item_id = item.id
        while len(self._items) > self._max_items:
            self._items.popitem(last=False)
        return previous

    def saved(self) -> dict:
        """Its items and last item id, as JSON (a checkpoint: `serve.resume`)."""
        return {"items": [item.model_dump(mode="json") for item in self._items.values()],
                "last_item_id": self.last_item_id}

    def load(self, saved: dict) -> None:
        """`saved()`'s items into this conversation, still empty (a restored session's)."""
        assert not self._items and self.last_item_id is None
        for data in saved["items"]:
            self.add(se.ItemOut.model_validate(data))
        self.last_item_id = saved["last_item_id"]

    def update(self, item: se.ItemOut) -> None:
        """An item's final form (an assistant item once its response is done)."""
        if item.id in self._items:
            self._items[item.id] = item

    def get(self, item_id: str) -> se.ItemOut:
        item = self._items.get(item_id)
        if item is None:
            raise ClientError(ErrorCode.ITEM_NOT_FOUND, f"no item {item_id!r} in this "
                              f"conversation (the last {self._max_items} items are kept)",
                              "item_id")
        return item

    def set_transcript(self, item_id: str, transcript: str) -> None:
        """A user audio item's transcript, once its turn is heard to the end."""
        item = self._items.get(item_id)
        if item is not None and item.content and item.content[0].type == "input_audio":
            content = [item.content[0].model_copy(update={"transcript": transcript})]
            self._items[item_id] = item.model_copy(update={"content": content})
