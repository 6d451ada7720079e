"""classify_turn's checks of a user classifier's result: well-formed verdicts pass as before,
malformed ones and exceptions become ClassifierFailed (a 500 that keeps the chain); a redacted
output text drops the logprobs that spelled the secret."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import pytest

from hotloop.pipeline import classifiers
from hotloop.pipeline.classify import ALLOW, Block, Finding, Flag, Redact, SecretsClassifier, with_texts
from hotloop.protocol.request import InputText, Message, OutputText
from tests.unit.test_secrets import POSITIVES

GH = next(secret for kind, _, secret, _ in POSITIVES if kind == "github_token")


class Returns:
    name = "returns"

    def __init__(self, result: Any) -> None:
        self.result = result

    def initial_state(self) -> int:
        return 0

    def classify(self, items: Sequence[Any], state: int) -> Any:
        return self.result(items) if callable(self.result) else self.result


def msg(text: str) -> Message:
    return Message(role="user", content=[InputText(text=text)])


def test_well_formed_results_pass() -> None:
    items: list[Any] = [msg("a"), msg("b")]
    finding = Finding(0, ("content", 0, "text"), "mine", 0, 1)
    for result, labels in [
        ((ALLOW, 1), None),
        ([ALLOW, 1], None),  # a list, as before
        ((Flag(labels=["x"]), 1), ["x"]),  # type: ignore[arg-type]
        ((Flag(labels=("x",), findings=(finding,)), 1), ("x",)),
        ((Redact(labels=("r",), findings=(), items=tuple(items)), 1), ("r",)),
    ]:
        out = classifiers.classify_turn([Returns(result)], items, None)
        assert out.block is None and out.states == {"returns": 1}
        assert [v.labels for _, v in out.verdicts] == ([] if labels is None else [labels])  # type: ignore[union-attr]
    out = classifiers.classify_turn([Returns((Block(reason="no", findings=(finding,)), 2))], items, None)
    assert out.block is not None and classifiers.blocked_error(out.block[1]).param == "input[0].content[0].text"


@pytest.mark.parametrize("result", [
    None,
    ALLOW,
    ("block", 0),
    (ALLOW, 0, 0),
    (Flag(labels="pii"), 0),  # type: ignore[arg-type]
    (Flag(labels=("x",), findings=("here",)), 0),  # type: ignore[arg-type]
    (Redact(labels=("x",), findings=(), items=()), 0),
    (Block(reason=None), 0),  # type: ignore[arg-type]
    (Block(reason="no", code=5), 0),  # type: ignore[arg-type]
])
def test_malformed_results_fail_the_turn(result: Any, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(classifiers.ClassifierFailed) as info:
        classifiers.classify_turn([Returns(result)], [msg("a")], None)
    err = info.value
    assert (err.status, err.type, err.code, err.param) == (500, "server_error", "classifier_error", None)
    from hotloop.server.engine import _KEEPS_PARENT

    assert isinstance(err, _KEEPS_PARENT)  # the engine keeps the parent cached
    assert "classifier returns failed (it returned" in caplog.text


def test_an_exception_fails_the_turn_and_logs_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    def boom(items: Sequence[Any]) -> Any:
        raise KeyError("config")

    with pytest.raises(classifiers.ClassifierFailed):
        classifiers.classify_turn([SecretsClassifier("flag"), Returns(boom)], [msg("a")], None)
    [record] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert record.exc_info is None
    assert "classifier returns failed (KeyError: 'config' at " in record.getMessage()
    assert "test_classifiers_audit.py:" in record.getMessage()


def test_redacting_an_output_text_drops_its_logprobs() -> None:
    lp = [{"token": GH, "logprob": -0.1, "bytes": list(GH.encode()), "top_logprobs": []}]
    ok = [{"token": "ok", "logprob": -0.2, "bytes": [111, 107], "top_logprobs": []}]
    item = Message(role="assistant", content=[OutputText(text="k " + GH, logprobs=lp), OutputText(text="ok", logprobs=ok)])
    out = classifiers.classify_turn([SecretsClassifier("redact")], [item], None)
    [redacted] = out.items
    assert isinstance(redacted, Message) and not isinstance(redacted.content, str)
    first, second = redacted.content
    assert isinstance(first, OutputText) and first.text == "k [REDACTED:github_token]" and first.logprobs == []
    assert second is item.content[1]  # untouched parts are the same objects
    assert GH not in msgspec.json.encode(redacted).decode()
    # an annotation edit alone keeps the logprobs (the text is unchanged)
    noted = Message(role="assistant", content=[OutputText(text="ok", annotations=[{"url": "x"}], logprobs=ok)])
    again = with_texts(noted, [(("content", 0, "annotations", 0, "url"), "y")])
    assert again.content[0].logprobs == ok and again.content[0].annotations == [{"url": "y"}]
