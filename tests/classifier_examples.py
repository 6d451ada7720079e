"""Classifiers the tests load with ``--classifier tests.classifier_examples:ATTR``.

``counting`` (a factory) makes a :class:`Counting` classifier: it records every text it is shown
(in memory, and as JSON lines in ``$HOTLOOP_TEST_CLASSIFIER_LOG`` when set, so a test can read
what a server process saw) and keeps a per-chain count of turns and items. A text containing
``flag-me`` is flagged, one containing ``block-me`` is blocked.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import msgspec

from hotloop.pipeline.classify import ALLOW, Block, Flag, Verdict, item_texts


class CountingState(msgspec.Struct, frozen=True):
    turns: int = 0
    items: int = 0


class Counting:
    name = "counting"
    state_type = CountingState

    def __init__(self) -> None:
        self.seen: list[tuple[CountingState, list[str]]] = []  # (state before, texts) per call

    def initial_state(self) -> CountingState:
        return CountingState()

    def classify(self, items: Sequence[Any], state: CountingState) -> tuple[Verdict, CountingState]:
        texts = [t for it in items for _, t in item_texts(it)]
        self.seen.append((state, texts))
        path = os.environ.get("HOTLOOP_TEST_CLASSIFIER_LOG")
        if path:
            with open(path, "a") as fh:
                fh.write(json.dumps({"turns": state.turns, "items": state.items, "texts": texts}) + "\n")
        after = CountingState(state.turns + 1, state.items + len(items))
        if any("block-me" in t for t in texts):
            return Block(reason="The input asks to be blocked.", labels=("blocked",)), after
        if any("flag-me" in t for t in texts):
            return Flag(labels=("flag_me",)), after
        return ALLOW, after


def counting() -> Counting:
    return Counting()


instance = Counting()
not_a_classifier = 42


def broken_factory() -> Counting:
    raise RuntimeError("no configuration")
