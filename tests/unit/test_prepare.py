"""Pre-inference planning: deferred counting gives the same numbers as inline counting."""

from __future__ import annotations

import json

from hotloop.pipeline import items as itemlib
from hotloop.pipeline.prepare import finished, prepare
from hotloop.protocol.objects import IdGen, response_object
from hotloop.protocol.request import decode_body, validate

BIG_TOOL = {"type": "function", "name": "f", "description": "d " * 6000, "parameters": {"type": "object", "properties": {}}}


def plan_for(body: dict, parent=None, cache=None, defer=False):
    return prepare(validate(decode_body(json.dumps(body))), parent, IdGen(deterministic=True), cache, defer=defer)


def test_deferred_settings_keep_cached_tokens() -> None:
    body = {"model": "m", "input": "hi", "tools": [BIG_TOOL]}
    first = plan_for(body, cache=itemlib.TokenCache())
    response = response_object(first.prepared, "resp_1", 0)
    response["output"] = []
    parent = finished(first, response)
    inline = plan_for({**body, "previous_response_id": "resp_1"}, parent, cache=itemlib.TokenCache())
    deferred = plan_for({**body, "previous_response_id": "resp_1"}, parent, cache=itemlib.TokenCache(), defer=True)
    assert not deferred.settled and deferred.pending_blobs  # the big tool is counted off the loop
    deferred.settle(itemlib.count_pending(*deferred.pending_texts()))
    assert (deferred.input_tokens, deferred.cached_tokens) == (inline.input_tokens, inline.cached_tokens)
    assert inline.cached_tokens >= 6000
