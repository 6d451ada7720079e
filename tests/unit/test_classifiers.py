"""Classifiers wired into a turn: loading specs, running over new items only, states carried
through the chain (caches and the store), incremental verdicts equal to whole-history ones."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec
import pytest
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from hotloop import errors
from hotloop.config import Config
from hotloop.pipeline import classifiers
from hotloop.pipeline.classify import Flag, SecretsClassifier, SecretsState
from hotloop.protocol.request import FunctionCall, FunctionCallOutput, InputText, Message
from hotloop.server.runner import make_app
from tests import classifier_examples
from tests.unit.test_secrets import POSITIVES

_R = TypeVar("_R")

SECRETS = [(kind, secret) for kind, _, secret, _ in POSITIVES]


# -- loading -------------------------------------------------------------------------------------


def test_load_instance_and_factory() -> None:
    inst = classifiers.load("tests.classifier_examples:instance")
    assert inst is classifier_examples.instance
    made = classifiers.load("tests.classifier_examples:counting")
    assert isinstance(made, classifier_examples.Counting) and made is not inst
    assert isinstance(classifiers.load("tests.classifier_examples:Counting"), classifier_examples.Counting)


@pytest.mark.parametrize(
    "spec, says",
    [
        ("tests.classifier_examples", "expected module:attr"),
        (":counting", "expected module:attr"),
        ("tests.no_such_module:x", "cannot import 'tests.no_such_module'"),
        ("tests.classifier_examples:nope", "has no attribute 'nope'"),
        ("tests.classifier_examples:not_a_classifier", "neither a classifier"),
        ("tests.classifier_examples:broken_factory", "broken_factory() failed: no configuration"),
        ("tests.classifier_examples:CountingState", "not a classifier"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec: str, says: str) -> None:
    with pytest.raises(classifiers.ClassifierLoadError) as ei:
        classifiers.load(spec)
    assert says in str(ei.value) and spec in str(ei.value)


def test_build_orders_secrets_first_and_rejects_duplicate_names() -> None:
    built = classifiers.build("redact", ["tests.classifier_examples:counting"])
    assert [c.name for c in built] == ["secrets", "counting"] and built[0].policy == "redact"  # type: ignore[attr-defined]
    assert classifiers.build("off") == []
    with pytest.raises(classifiers.ClassifierLoadError, match="named 'counting'"):
        classifiers.build("off", ["tests.classifier_examples:counting", "tests.classifier_examples:instance"])
    with pytest.raises(classifiers.ClassifierLoadError, match="secrets policy"):
        classifiers.build("loud")


def test_bad_spec_fails_app_construction() -> None:
    with pytest.raises(classifiers.ClassifierLoadError):
        make_app(Config(store="memory", classifiers="tests.classifier_examples:nope"))


def test_config_reads_specs_from_env() -> None:
    cfg = Config.from_env({"HOTLOOP_CLASSIFIERS": "a.b:c, d:e", "HOTLOOP_SECRETS": "block"})
    assert cfg.classifier_specs == ["a.b:c", "d:e"] and cfg.secrets == "block"
    assert Config().secrets == "flag" and Config().classifier_specs == []


# -- one turn ------------------------------------------------------------------------------------


def msg(text: str) -> Message:
    return Message(role="user", content=text)


def test_redaction_feeds_the_next_classifier_and_block_stops_the_turn() -> None:
    kind, secret = SECRETS[0]
    counting = classifier_examples.Counting()
    out = classifiers.classify_turn([SecretsClassifier("redact"), counting], [msg("k " + secret)], None)
    assert out.block is None and [n for n, _ in out.verdicts] == ["secrets"]
    assert out.items[0].content == f"k [REDACTED:{kind}]"  # type: ignore[union-attr]
    assert counting.seen[0][1] == [f"k [REDACTED:{kind}]"]  # never saw the secret
    assert out.states["counting"] == classifier_examples.CountingState(1, 1)
    assert out.tally() == {kind: 1}
    blocked = classifiers.classify_turn([SecretsClassifier("block"), counting], [msg("k " + secret)], out.states)
    assert blocked.block is not None and blocked.block[0] == "secrets"
    assert len(counting.seen) == 1  # classifiers after a block do not run
    assert blocked.states["counting"] == out.states["counting"]


def test_blocked_error_names_item_and_field_but_not_the_secret() -> None:
    kind, secret = next(s for s in SECRETS if s[0] == "github_token")
    items = [
        msg("hello"),
        FunctionCall(call_id="c1", name="sh", arguments="{}"),
        FunctionCallOutput(call_id="c1", output="fine"),
        FunctionCallOutput(call_id="c1", output="token " + secret),
    ]
    out = classifiers.classify_turn([SecretsClassifier("block")], items, None)
    assert out.block is not None
    err = classifiers.blocked_error(out.block[1])
    body = err.body()
    assert err.status == 400 and body["type"] == "invalid_request_error"
    assert body["code"] == "secret_detected" and body["param"] == "input[3].output"
    assert kind in body["message"] and secret not in body["message"]
    parts = [Message(role="user", content=[InputText(text="x"), InputText(text=secret)])]
    out = classifiers.classify_turn([SecretsClassifier("block")], parts, None)
    assert classifiers.blocked_error(out.block[1]).param == "input[0].content[1].text"  # type: ignore[index]
    assert classifiers.blocked_error(out.block[1], string_input=True).param == "input"  # type: ignore[index]


def test_states_freeze_to_json_and_thaw_with_state_type(caplog: pytest.LogCaptureFixture) -> None:
    sc = SecretsClassifier("flag")
    state = SecretsState(frozenset({"jwt", "npm_token"}), 3)
    raw = classifiers.freeze({"secrets": state, "plain": {"n": 1}})
    assert raw == {"secrets": {"kinds_seen": ["jwt", "npm_token"], "findings": 3}, "plain": {"n": 1}}
    assert msgspec.json.decode(msgspec.json.encode(raw)) == raw
    thawed = classifiers.frozen(raw)
    assert thawed is not None
    assert classifiers.thaw(sc, thawed["secrets"]) == state
    assert classifiers.thaw(classifier_examples.Counting(), classifiers.Frozen({"turns": 2})) == classifier_examples.CountingState(2, 0)
    # a classifier without state_type gets the JSON value; a frozen state survives a refreeze
    assert classifiers.thaw(object(), thawed["plain"]) == {"n": 1}  # type: ignore[arg-type]
    assert classifiers.freeze(thawed) == raw
    with caplog.at_level(logging.WARNING, "hotloop.classify"):
        assert classifiers.thaw(sc, classifiers.Frozen({"findings": "many"})) == SecretsState()
        big = classifiers.freeze({"big": "x" * (classifiers.MAX_STATE_BYTES + 1), "odd": object(), "ok": 1})
    assert big == {"ok": 1}
    assert "big" in caplog.text and "odd" in caplog.text
    assert classifiers.freeze({}) is None and classifiers.frozen(None) is None


def test_tally_is_bounded() -> None:
    from hotloop.pipeline.classify import Finding

    many = tuple(Finding(0, ("content",), f"k{i}", 0, 1) for i in range(100))
    out = classifiers.Outcome([], {}, [("x", Flag(labels=("l",), findings=many)), ("y", Flag(labels=("a", "b")))], None)
    tally = out.tally()
    assert len(tally) == classifiers.MAX_TALLY_KINDS and sum(tally.values()) == 102


# -- incremental equals from scratch -------------------------------------------------------------

_NOISE = st.text(alphabet="abc xyz=:\n_-", max_size=30)


@st.composite
def histories(draw: Any) -> tuple[list[Message], list[int]]:
    n = draw(st.integers(1, 12))
    items = []
    for _ in range(n):
        parts = [draw(_NOISE)]
        for _ in range(draw(st.integers(0, 2))):
            parts.append(draw(st.sampled_from(SECRETS))[1])
            parts.append(draw(_NOISE))
        items.append(msg(" ".join(parts)))
    cuts = sorted(set(draw(st.lists(st.integers(1, n), max_size=n))) | {n})
    return items, cuts


@settings(max_examples=60, deadline=None)
@given(histories(), st.sampled_from(["flag", "redact", "block"]))
def test_incremental_verdicts_equal_whole_history(case: tuple[list[Message], list[int]], policy: str) -> None:
    items, cuts = case
    sc = SecretsClassifier(policy)  # type: ignore[arg-type]
    whole = classifiers.classify_turn([sc], items, None)
    states: dict[str, Any] | None = None
    findings: list[tuple[int, Any, str, int, int]] = []
    kinds: set[str] = set()
    used: list[Any] = []
    start = 0
    for end in cuts:
        turn = classifiers.classify_turn([sc], items[start:end], states)
        # through the store and back, as a reloaded chain would continue
        states = classifiers.frozen(classifiers.freeze(turn.states))
        for _, v in turn.verdicts:
            findings += [(f.item_index + start, f.path, f.kind, f.start, f.end) for f in v.findings]  # type: ignore[union-attr]
        if turn.block is not None:
            kinds |= {lbl.removeprefix("secret:") for lbl in turn.block[1].labels}
        else:
            kinds |= {f[2] for f in findings}
        used += turn.items
        start = end
    final = classifiers.thaw(sc, states["secrets"]) if states else SecretsState()  # type: ignore[index]
    assert final == whole.states["secrets"]
    if policy == "block":
        assert (whole.block is None) == (not kinds)
        if whole.block is not None:
            assert set(whole.block[1].labels) == {f"secret:{k}" for k in kinds}
        return
    whole_findings = [(f.item_index, f.path, f.kind, f.start, f.end) for _, v in whole.verdicts for f in v.findings]  # type: ignore[union-attr]
    assert findings == whole_findings
    assert used == whole.items
    assert final.findings == len(whole_findings)


# -- in a server: new items only, states through caches and the store ----------------------------


def _app(data_dir: Path, **kw: Any) -> Any:
    cfg = Config(store="sqlite", data_dir=str(data_dir), sim_rate=0, classifiers="tests.classifier_examples:counting", **kw)
    return make_app(cfg)


async def _chain(app: Any, turns: list[str], prev: str | None, store: bool = True) -> list[str]:
    ids = []
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        for text in turns:
            body = {"model": "hotloop-sim", "input": text, "previous_response_id": prev, "store": store,
                    "metadata": {"sim": "tokens:3"}}
            r = await client.post("/v1/responses", json=body)
            assert r.status_code == 200, r.text
            prev = r.json()["id"]
            ids.append(prev)
    return ids


def test_a_chain_is_classified_one_new_item_at_a_time_also_after_a_reload(tmp_path: Path) -> None:
    async def main() -> None:
        app = _app(tmp_path)
        await app.startup()
        try:
            ids = await _chain(app, [f"turn {i}" for i in range(10)], None)
            counting = app.engine.classifiers[-1]
            assert [texts for _, texts in counting.seen] == [[f"turn {i}"] for i in range(10)]
            assert [s for s, _ in counting.seen] == [classifier_examples.CountingState(i, i) for i in range(10)]
            await app.persistence.flush()
        finally:
            await app.shutdown()
        # a fresh process on the same data dir: the parent comes from SQLite with its states
        app = _app(tmp_path)
        await app.startup()
        try:
            await _chain(app, ["turn 10", "turn 11"], ids[-1])
            counting = app.engine.classifiers[-1]
            assert counting.seen == [
                (classifier_examples.CountingState(10, 10), ["turn 10"]),
                (classifier_examples.CountingState(11, 11), ["turn 11"]),
            ]
            # a fork of an older stored response starts from that response's state
            await _chain(app, ["fork"], ids[3])
            assert counting.seen[-1] == (classifier_examples.CountingState(4, 4), ["fork"])
            # the process cache serves the next one: still only the new item
            await _chain(app, ["turn 12"], None)
        finally:
            await app.shutdown()

    uvloop.run(main())


def test_secrets_state_is_stored_with_the_response(tmp_path: Path) -> None:
    kind, secret = next(s for s in SECRETS if s[0] == "npm_token")

    async def main() -> Any:
        app = make_app(Config(store="sqlite", data_dir=str(tmp_path), sim_rate=0))
        await app.startup()
        try:
            ids = await _chain(app, ["a " + secret, "b " + secret], None)
            await app.persistence.flush()
            return app.persistence.store.get(ids[-1]).states
        finally:
            await app.shutdown()

    assert uvloop.run(main()) == {"secrets": {"kinds_seen": [kind], "findings": 2}}


def test_large_input_is_scanned_in_the_tokenizer_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kind, secret = next(s for s in SECRETS if s[0] == "github_token")
    from hotloop.server import engine as engine_mod

    threads: list[str] = []
    real = classifiers.classify_turn

    def spy(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(classifiers, "classify_turn", spy)
    big = "x " * (engine_mod.CLASSIFY_OFFLOAD_CHARS // 2) + secret

    async def main() -> Any:
        app = make_app(Config(store="memory", sim_rate=0, secrets="redact"))
        await app.startup()
        try:
            [rid] = await _chain(app, [big], None)
            await _chain(app, ["small " + secret], rid)
            entry = app.engine.responses.get(rid)
            return entry.input_items[0].content[0].text
        finally:
            await app.shutdown()

    text = uvloop.run(main())
    assert text.endswith(f"[REDACTED:{kind}]") and secret not in text
    assert threads[0].startswith("hotloop-tokenize") and threads[1] == "MainThread"


@contextlib.asynccontextmanager
async def _flag_app(release: threading.Event, **config: Any) -> AsyncIterator[Any]:
    """A started app under the flag policy; ``release`` is set on the way out, so no test leaves
    the tokenizer thread blocked."""
    app = make_app(Config(store="memory", sim_rate=0, secrets="flag", **config))
    await app.startup()
    try:
        yield app
    finally:
        release.set()
        await app.shutdown()


def _run_logged(caplog: pytest.LogCaptureFixture, main: Callable[[], Awaitable[_R]]) -> _R:
    """``main()`` run on uvloop, with the engine's INFO lines captured."""
    with caplog.at_level(logging.INFO, "hotloop.engine"):
        return uvloop.run(main())


def _spied_settings_scans(monkeypatch: pytest.MonkeyPatch, hook: Any = None) -> tuple[list[str], str, str, str]:
    """Record the thread of every settings scan (``hook()`` runs in it first); and instructions
    large enough for the tokenizer thread holding a GitHub token: (threads, kind, secret, text)."""
    from hotloop.server import engine as engine_mod

    kind, secret = next(s for s in SECRETS if s[0] == "github_token")
    threads: list[str] = []
    real = SecretsClassifier.classify_settings

    def spy(self: SecretsClassifier, p: Any, owner: str = "") -> Any:
        threads.append(threading.current_thread().name)
        if hook is not None:
            hook()
        return real(self, p, owner)

    monkeypatch.setattr(SecretsClassifier, "classify_settings", spy)
    return threads, kind, secret, "x " * (engine_mod.CLASSIFY_OFFLOAD_CHARS // 2) + secret


@pytest.mark.parametrize("policy", ["flag", "redact", "block"])
def test_large_instructions_are_scanned_in_the_tokenizer_thread_once(monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    """Instructions of CLASSIFY_OFFLOAD_CHARS or more that the settings cache has not seen are
    scanned off the event loop, under every policy; sent again, they are a cache hit, scanned on
    the loop (no thread hop), with the same outcome."""
    threads, kind, secret, big = _spied_settings_scans(monkeypatch)

    async def main() -> tuple[list[httpx.Response], list[dict[str, Any]]]:
        app = make_app(Config(store="memory", sim_rate=0, secrets=policy))
        await app.startup()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                body = {"model": "big-settings", "input": "hi", "instructions": big, "metadata": {"sim": "tokens:3"}}
                answers = [await client.post("/v1/responses", json=body) for _ in range(2)]
                await app.persistence.flush()
                rows = (await client.get("/hotloop/usage")).json()["data"]
            return answers, [r for r in rows if r["model"] == "big-settings"]
        finally:
            await app.shutdown()

    answers, rows = uvloop.run(main())
    assert threads[0].startswith("hotloop-tokenize") and threads[1:] == ["MainThread"]
    if policy == "block":
        for r in answers:
            assert r.status_code == 400
            assert r.json()["error"]["code"] == "secret_detected" and r.json()["error"]["param"] == "instructions"
        assert rows == []
        return
    assert [r.status_code for r in answers] == [200, 200]
    shown = [r.json()["instructions"] for r in answers]
    if policy == "redact":
        assert shown[0] == shown[1] == big.replace(secret, f"[REDACTED:{kind}]")
    else:
        assert shown == [big, big]
        [row] = rows
        assert row["flagged"] == 2


@pytest.mark.parametrize("case", ["cancelled, scan queued", "cancelled, scan running", "refused by the backend", "failed before its request"])
def test_a_start_that_fails_keeps_its_deferred_settings_scan_once_its_request_went_out(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    """Under the flag policy, large instructions are scanned in the tokenizer thread after the
    backend request is out. A start that fails after that (its client left while the backend
    worked, with the scan queued behind the thread's other work or under way; or the backend
    refused the request) still scans them and logs the secret it sent. One that fails before its
    request goes out drops the scan: nothing was sent."""
    import asyncio
    import json

    from hotloop.protocol.request import decode_body
    from hotloop.server.engine import Engine

    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(10)

    scans, _, _, big = _spied_settings_scans(monkeypatch, hold if case == "cancelled, scan running" else None)
    sim = "rate_limit" if case == "refused by the backend" else "tokens:3"
    body = {"model": "m", "input": "hi", "store": False, "instructions": big, "metadata": {"sim": sim}}
    if case == "failed before its request":

        def broken(self: Engine, plan: Any) -> Any:
            raise errors.ServerError("The backend request could not be made.")

        monkeypatch.setattr(Engine, "backend_request", broken)

    async def main() -> None:
        async with _flag_app(release, sim_ttft=5.0) as app:
            engine = app.engine
            loop = asyncio.get_running_loop()
            busy = None if case == "cancelled, scan running" else loop.run_in_executor(engine._tokenize_pool, release.wait, 10)
            start = asyncio.ensure_future(engine.start(decode_body(json.dumps(body).encode()), transport="json"))
            if case.startswith("cancelled"):
                for _ in range(500):  # bounded: the scan is queued, or under way, while the backend works
                    if (busy is not None and engine._tokenize_pool._work_queue.qsize()) or entered.is_set():
                        break
                    await asyncio.sleep(0.01)
                assert not start.done()
                start.cancel()
            with pytest.raises((asyncio.CancelledError, errors.HotloopError)):
                await start
            release.set()
            for _ in range(3):
                await asyncio.sleep(0)  # a scan scheduled for the loop's next iteration is submitted
            await loop.run_in_executor(engine._tokenize_pool, lambda: None)  # the thread's work is done
            for _ in range(3):
                await asyncio.sleep(0)  # and its callbacks have run

    _run_logged(caplog, main)
    assert "scan failed" not in caplog.text
    if case == "failed before its request":
        assert scans == [] and "flagged" not in caplog.text
    else:
        assert scans == ["hotloop-tokenize_0"]
        assert "classifier secrets flagged the instructions, tools or format of a request" in caplog.text


def test_deferred_settings_scans_are_bounded(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """At most MAX_DEFERRED_SCANS settings scans wait for the tokenizer thread at once: past it a
    request's scan is skipped with a warning and its response goes on unflagged; once the queue
    drains, scans are deferred again."""
    import asyncio
    import json

    from hotloop.protocol.request import decode_body
    from hotloop.server import engine as engine_mod

    monkeypatch.setattr(engine_mod, "MAX_DEFERRED_SCANS", 2)
    scans, _, _, big = _spied_settings_scans(monkeypatch)
    release = threading.Event()

    async def main() -> list[dict[str, Any]]:
        async with _flag_app(release) as app:
            engine = app.engine
            loop = asyncio.get_running_loop()
            busy = loop.run_in_executor(engine._tokenize_pool, release.wait, 10)

            async def one(i: int) -> dict[str, Any]:
                body = {"model": "m", "input": "hi", "instructions": f"{big} {i}", "metadata": {"sim": "tokens:3"}}  # not cached
                run = await engine.start(decode_body(json.dumps(body).encode()), transport="json")
                return await run.drain()

            tasks = [asyncio.ensure_future(one(i)) for i in range(3)]
            for _ in range(500):  # bounded: until the third start's scan was decided
                if "is skipped" in caplog.text:
                    break
                await asyncio.sleep(0.01)
            assert engine._deferred_scans == 2
            release.set()
            await busy
            done = await asyncio.gather(*tasks)
            assert engine._deferred_scans == 0
            done.append(await one(3))  # room again: deferred and flagged
            await app.persistence.flush()
            return done

    responses = _run_logged(caplog, main)
    assert [r["status"] for r in responses] == ["completed"] * 4
    assert scans == ["hotloop-tokenize_0"] * 3
    assert caplog.text.count("is skipped: 2 scans wait for the tokenizer thread") == 1
    assert caplog.text.count("flagged the instructions, tools or format of a request") == 3


def test_a_response_whose_client_leaves_before_its_deferred_settings_scan_ends_is_still_flagged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A response that started (its request went to the backend, ``response.created`` went out)
    and whose client goes away while its terminal event waits for the settings scan in the
    tokenizer thread: the scan still runs, and its flag is logged."""
    import asyncio
    import json

    from hotloop.protocol.request import decode_body

    release = threading.Event()
    scans, _, _, big = _spied_settings_scans(monkeypatch)
    body = {"model": "m", "input": "hi", "store": False, "instructions": big, "metadata": {"sim": "tokens:3"}, "stream": True}

    async def main() -> list[str]:
        async with _flag_app(release) as app:
            engine = app.engine
            loop = asyncio.get_running_loop()
            busy = loop.run_in_executor(engine._tokenize_pool, release.wait, 10)  # the scan queues
            run = await engine.start(decode_body(json.dumps(body).encode()), transport="sse")
            names: list[str] = []

            async def client() -> None:
                async for batch in run.frames():
                    names.extend(name for name, _ in batch)

            reader = asyncio.ensure_future(client())
            for _ in range(500):  # bounded: until the run waits for the scan before its terminal event
                if "response.created" in names and run.verdicts is None:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            assert not reader.done()
            reader.cancel()  # the client goes away
            await asyncio.gather(reader, return_exceptions=True)
            release.set()
            await busy
            await loop.run_in_executor(engine._tokenize_pool, lambda: None)
            for _ in range(3):
                await asyncio.sleep(0)
            return names

    names = _run_logged(caplog, main)
    assert "response.created" in names and "response.completed" not in names
    assert scans == ["hotloop-tokenize_0"]
    assert "flagged the instructions" in caplog.text


def test_no_classifiers_means_no_states(tmp_path: Path) -> None:
    async def main() -> Any:
        app = make_app(Config(store="memory", sim_rate=0, secrets="off"))
        await app.startup()
        try:
            assert app.engine.classifiers == []
            [rid] = await _chain(app, ["hello"], None)
            return app.engine.responses.get(rid).states
        finally:
            await app.shutdown()

    assert uvloop.run(main()) is None





def test_a_request_whose_client_left_during_prefill_is_flagged_in_the_metrics_as_in_the_ledger() -> None:
    """Its client left while the backend prepared the first token: no response, but the ledger
    charges it with its findings, and so do the metrics (they missed it: no run to observe)."""
    import asyncio
    import json

    from hotloop.protocol.request import decode_body

    kind, secret = SECRETS[0]

    async def main() -> tuple[str, list[dict[str, Any]]]:
        app = make_app(Config(store="memory", sim_rate=0, sim_ttft=5.0))
        await app.startup()
        try:
            body = {"model": "m", "input": f"here: {secret}", "store": False, "metadata": {"sim": "tokens:3"}}
            start = asyncio.ensure_future(app.engine.start(decode_body(json.dumps(body).encode()), transport="json"))
            await asyncio.sleep(0.3)  # the backend's first token is 5 s away
            start.cancel()  # the client leaves
            await asyncio.gather(start, return_exceptions=True)
            await app.persistence.flush()
            assert app.metrics is not None
            return app.metrics.render().decode(), await app.persistence.usage()
        finally:
            await app.shutdown()

    metrics, rows = uvloop.run(main())
    assert [(r["responses"], r["flagged"], r["findings"]) for r in rows] == [(1, 1, {kind: 1})]
    assert "\nhotloop_classified_responses_total 1.0\n" in metrics
    assert f'hotloop_classifier_findings_total{{kind="{kind}"}} 1.0' in metrics
