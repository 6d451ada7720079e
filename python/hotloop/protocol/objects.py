"""The Response object and its parts, built from a validated request. Sans-I/O.

Ids come from an injectable :class:`IdGen` so tests (and golden transcripts) are deterministic.
"""

from __future__ import annotations

import itertools
import secrets
from typing import Any

import msgspec

from hotloop.protocol.events import RESPONSE_OBJECT
from hotloop.protocol.request import ENCRYPTED_REASONING, Prepared


class IdGen:
    """Makes ``resp_``/``msg_``/``fc_``/``call_``/``rs_`` ids: random, or sequential for tests.

    Random ids are ``id_bytes`` (24) bytes from the OS CSPRNG (a response id is a capability for reading the
    response), taken from a 4 KiB pool refilled by one ``urandom`` call, not one syscall per id.
    """

    _POOL = 4096

    def __init__(self, deterministic: bool = False, prefix: str = "", id_bytes: int = 24) -> None:
        self._counter = itertools.count(1) if deterministic else None
        self._prefix = prefix
        self._id_bytes = id_bytes
        self._pool = b""
        self._pos = 0

    def forget(self) -> None:
        """Drop the unused random bytes (a forked child must not hand out its parent's ids)."""
        self._pool, self._pos = b"", 0

    def new(self, kind: str) -> str:
        if self._counter is not None:
            return f"{kind}_{self._prefix}{next(self._counter):04d}"
        pos = self._pos
        if pos + self._id_bytes > len(self._pool):
            self._pool = secrets.token_bytes(self._POOL)
            pos = 0
        self._pos = pos + self._id_bytes
        return f"{kind}_{self._pool[pos : pos + self._id_bytes].hex()}"


def usage_object(
    input_tokens: int, output_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0, truncated_items: int = 0
) -> dict[str, Any]:
    """The full usage object: every field present (openai-python and Codex require them).
    ``input_tokens_details.cache_write_tokens`` is always 0: openai-python 3.x types it as a
    required int (OpenAI sends 0 when nothing was written to its cache) and no backend reports
    it. ``truncated_items``: hotloop's own field (OpenAI's usage has none), the input items
    ``truncation: "auto"`` dropped, present only when some were (clients' usage types keep or
    ignore a field they do not know)."""
    usage = {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cache_write_tokens": 0, "cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }
    if truncated_items:
        usage["truncated_items"] = truncated_items
    return usage


def _text_object(p: Prepared) -> dict[str, Any]:
    text = p.req.text
    if text is None:
        return {"format": {"type": "text"}, "verbosity": "medium"}
    # the format's type is always there, "text" included (the struct omits its defaults)
    out: dict[str, Any] = {"format": {"type": text.format.type, **msgspec.to_builtins(text.format)}}
    out["verbosity"] = text.verbosity or "medium"
    return out


def _reasoning_object(p: Prepared) -> dict[str, Any]:
    r = p.req.reasoning
    if r is None:
        return {"effort": None, "summary": None}
    return {"effort": r.effort, "summary": r.summary}


def wants_summary(p: Prepared) -> bool:
    """Whether the request asks for reasoning summaries: ``reasoning.summary`` ("auto",
    "concise" or "detailed"; Codex sends "auto" on every turn), or the deprecated
    ``generate_summary``. Its response's reasoning is then streamed as a summary
    (:class:`~hotloop.protocol.turn.Turn`, ``reasoning_summary``); null or absent, as raw
    ``reasoning_text``."""
    r = p.req.reasoning
    return r is not None and (r.summary is not None or r.generate_summary is not None)


def wants_encrypted_reasoning(p: Prepared) -> bool:
    """Whether the response's reasoning items carry ``encrypted_content``, the reasoning sealed
    by this server (:mod:`hotloop.protocol.sealed`): when the request's ``include`` asks for
    ``reasoning.encrypted_content`` (Codex does on every turn), and also whenever ``store`` is
    false, asked or not. A client that keeps no state here can send reasoning back only in that
    field, and the Vercel AI SDK drops every reasoning item without it from a ``store: false``
    request ("Reasoning parts without encrypted content are not supported when store is false")
    while asking for it only for model names it knows as OpenAI reasoning models (not
    gpt-oss-120b on Cerebras): without it, its tool loops would lose the model's reasoning
    between steps. A request that asks for neither gets no such field anywhere (its events are
    byte for byte what they were)."""
    req = p.req
    return not req.store or (req.include is not None and ENCRYPTED_REASONING in req.include)


def response_object(
    p: Prepared,
    response_id: str,
    created_at: int,
    *,
    model: str | None = None,
) -> dict[str, Any]:
    """The Response as ``response.created`` carries it: ``in_progress``, no output, no usage."""
    req = p.req
    return {
        "id": response_id,
        "object": RESPONSE_OBJECT,
        "created_at": created_at,
        "status": "in_progress",
        "background": False,
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "model": model or req.model,
        "output": [],
        "parallel_tool_calls": p.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "prompt_cache_retention": req.prompt_cache_retention,
        "reasoning": _reasoning_object(p),
        "safety_identifier": req.safety_identifier,
        "service_tier": req.service_tier or "default",
        "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": _text_object(p),
        "tool_choice": p.tool_choice,
        "tools": p.tools,
        "top_logprobs": req.top_logprobs or 0,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "usage": None,
        "user": req.user,
        "metadata": req.metadata or {},
    }
