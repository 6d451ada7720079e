"""Under ``--secrets redact`` a secret inside a call id becomes ``[REDACTED:<kind>:<tag>]``
(``tag``: a keyed hash of the secret), not the text marker ``[REDACTED:<kind>]``: two calls whose
ids held two different secrets of one kind got one id, and their outputs could no longer be told
apart. The same secret always gets the same marker, so a call and its output still pair."""

from __future__ import annotations

import hashlib
import re
import secrets as rnd
import string
from typing import Any

import msgspec
import pytest

from hotloop._pure import SecretScanner as PureScanner
from hotloop._pure import SECRET_PATTERNS
from hotloop.pipeline import classify
from hotloop.pipeline.classifiers import classify_turn
from hotloop.protocol.request import FunctionCall, FunctionCallOutput, Item, Message, OtherItem, decode_items

ALNUM = string.ascii_letters + string.digits
MARKER = re.compile(r"\[REDACTED:github_token:[0-9a-f]{12}\]")


def gh() -> str:
    return "gh" + "p_" + "".join(rnd.choice(ALNUM) for _ in range(36))


SCANNERS = {"default": None, "pure": PureScanner(SECRET_PATTERNS)}


def _redact(items: list[Item], impl: str = "default") -> Any:
    c = classify.SecretsClassifier("redact", SCANNERS[impl])
    verdict, _ = c.classify(items, c.initial_state())
    assert isinstance(verdict, classify.Redact)
    return verdict.items


def test_same_secret_same_marker_different_secrets_different_markers() -> None:
    a, b = gh(), gh()
    ma, mb = classify.call_id_marker("github_token", a), classify.call_id_marker("github_token", b)
    assert MARKER.fullmatch(ma) and MARKER.fullmatch(mb)
    assert ma == classify.call_id_marker("github_token", a)
    assert ma != mb
    assert a not in ma
    # keyed: not a plain hash of the secret anyone could compute to confirm a guess
    for h in (hashlib.sha256, hashlib.sha1, hashlib.md5, hashlib.blake2b):
        assert h(a.encode()).hexdigest()[:12] not in ma


@pytest.mark.parametrize("impl", sorted(SCANNERS))
def test_call_ids_get_distinct_stable_markers_and_texts_keep_the_kind_marker(impl: str) -> None:
    a, b = gh(), gh()
    items: list[Item] = [
        Message(role="user", content=f"tokens {a} and {b}"),
        FunctionCall(call_id=a, name="sh", arguments=f'{{"t": "{a}"}}'),
        FunctionCall(call_id="call-" + b, name="sh", arguments="{}"),
        FunctionCallOutput(call_id=a, output=f"out {a}"),
        FunctionCallOutput(call_id="call-" + b, output="out two"),
    ]
    new = _redact(items, impl)
    assert new[0].content == "tokens [REDACTED:github_token] and [REDACTED:github_token]"
    assert new[1].arguments == '{"t": "[REDACTED:github_token]"}'
    assert new[3].output == "out [REDACTED:github_token]"
    ida, idb = new[1].call_id, new[2].call_id
    assert MARKER.fullmatch(ida) and idb.startswith("call-") and MARKER.fullmatch(idb[5:])
    assert ida != idb[5:]
    assert new[3].call_id == ida and new[4].call_id == idb  # each output still names its call
    assert a not in str(new) and b not in str(new)
    # a later turn (another classifier instance, the other scanner) gives the same ids
    later = _redact([FunctionCallOutput(call_id=a, output="again")], "pure" if impl == "default" else "default")
    assert later[0].call_id == ida


def test_the_call_id_of_an_item_kept_verbatim_gets_the_call_id_marker() -> None:
    a, b = gh(), gh()
    items = decode_items([
        {"type": "custom_tool_call", "call_id": a, "name": "patch", "input": f"x {b}"},
        {"type": "custom_tool_call_output", "call_id": a, "output": "ok"},
    ])
    new = _redact(items)
    assert isinstance(new[0], OtherItem) and isinstance(new[1], OtherItem)
    assert MARKER.fullmatch(new[0].data["call_id"]) and new[0].data["call_id"] == new[1].data["call_id"]
    assert new[0].data["input"] == "x [REDACTED:github_token]"


def test_classify_turn_passes_the_call_id_markers_on() -> None:
    a, b = gh(), gh()
    items: list[Item] = [FunctionCall(call_id=a, name="f", arguments="{}"), FunctionCall(call_id=b, name="f", arguments="{}")]
    out = classify_turn([classify.SecretsClassifier("redact")], items, None)
    ids = [it.call_id for it in out.items if isinstance(it, FunctionCall)]
    assert len(ids) == len(set(ids)) == 2 and all(MARKER.fullmatch(i) for i in ids)
    assert a not in msgspec.json.encode(out.items).decode()
