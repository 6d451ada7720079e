"""A reasoning item's ``encrypted_content``: its reasoning text, sealed by this server. I/O-free.

Why: a client that keeps no state on the server (``store: false``: Codex on every turn, the
Vercel AI SDK when told so) can carry a model's reasoning from one request to the next only in
the reasoning item itself, as OpenAI's opaque ``encrypted_content``. The AI SDK goes further and
drops every reasoning item without one from a ``store: false`` request, so without it a tool
loop's next step reaches the model without the reasoning of its earlier calls (which gpt-oss
needs). Which responses get one: :func:`hotloop.protocol.objects.wants_encrypted_reasoning`.

Format: ``"hl1." + base64url(tag || text)``, without padding, where ``text`` is the item's
reasoning in UTF-8 (the model's raw reasoning, which is also its summary in summary mode:
:mod:`hotloop.protocol.turn`) and ``tag`` is 16 bytes of keyed BLAKE2b over ``_DOMAIN`` and the
text. The same text under the same key always seals to the same token (a MAC, no nonce).

Key: ``KEY_LABEL`` derived (:func:`hotloop.state.fpkey.derive`) from the store's fingerprint key,
set by the engine with :func:`use_key`; so it lives as that key does. The SQLite store keeps it
in the data directory (tokens open after a restart and in every ``--workers`` process), the
Redis store shares it between replicas (a token opens on any of them), the memory store (and a
``:memory:`` database) has one per process: its tokens do not survive a restart (an old token is
then ignored, below). Until :func:`use_key` is called, ``PROCESS_KEY``, random per process.

What it protects: integrity, not secrecy. The client already received the reasoning itself (its
deltas, the item's summary or content); what the token adds is that the text in it is what this
server's model produced: nobody without the key can make a token that opens, so text sent back
in one is the model's own reasoning and not something the client wrote in its place. What it does
not protect: the text is only encoded, not encrypted (anyone holding a token reads it); a token
is not bound to a response, a conversation or an API key (it carries only text its holder was
given with it), and is not revoked (a token stays good for as long as the key does).

Reading it back (:func:`reasoning_text`): a reasoning input item without raw content whose
token opens is reasoning history from the token's text. A token that does not open (another
server's, OpenAI's ``gAAAA...``, tampered, sealed under an old key) is ignored without an error
and the item's summary is used as before: a conversation may move between servers (a client
that switched its base URL, a replica of another deployment), and refusing it would end it,
where OpenAI would answer 400. The secrets classifier (:mod:`hotloop.pipeline.classify`) scans
the token as the opaque string it is stored and echoed as, not its text: a token that opens holds
only what this server's model produced (the MAC), output that no classifier scans when it is
produced or when it goes back to the model through ``previous_response_id``; a token's text is
model output coming back authenticated, as in a chain, not client input.

Cost: one seal per reasoning item, when it closes, for responses that ask; nothing per streamed
token. An unseal per reasoning item rendered or counted that has no raw content and has a token.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

from hotloop.protocol.request import Reasoning

PREFIX = "hl1."
TAG_LEN = 16
#: the label of this key's derivation from the store's fingerprint key (fpkey.derive)
KEY_LABEL = b"hotloop reasoning.encrypted_content key v1"
_DOMAIN = b"hotloop sealed reasoning hl1\x00"  # what the tag is of: this format's texts only
#: the key used until :func:`use_key` (a process without a store: tests, tools)
PROCESS_KEY = secrets.token_bytes(32)
_key = PROCESS_KEY


def use_key(key: bytes) -> None:
    """Seal and open tokens under ``key`` from now on (16 to 64 bytes; derive it with
    ``fpkey.derive(store_key, KEY_LABEL)``)."""
    global _key
    _key = key


def _tag(key: bytes, data: bytes) -> bytes:
    h = hashlib.blake2b(_DOMAIN, digest_size=TAG_LEN, key=key)
    h.update(data)
    return h.digest()


def seal(text: str, key: bytes | None = None) -> str:
    """The token of ``text`` (under the module's key, or ``key``). Never raises: a lone
    surrogate (which no JSON encoder writes, but a ``str`` may hold) round-trips too."""
    k = _key if key is None else key
    data = text.encode("utf-8", "surrogatepass")
    return PREFIX + base64.urlsafe_b64encode(_tag(k, data) + data).rstrip(b"=").decode("ascii")


def unseal(token: str, key: bytes | None = None) -> str | None:
    """The text sealed in ``token``, or None when it is not a token this key sealed (another
    server's, another format, tampered, truncated, an old key)."""
    if not token.startswith(PREFIX):
        return None
    body = token[len(PREFIX):]
    try:
        raw = base64.b64decode(body + "=" * (-len(body) % 4), altchars=b"-_", validate=True)
    except ValueError:  # (binascii.Error is one) not base64url, or not ASCII
        return None
    if len(raw) < TAG_LEN:
        return None
    data = raw[TAG_LEN:]
    if not hmac.compare_digest(raw[:TAG_LEN], _tag(_key if key is None else key, data)):
        return None
    return data.decode("utf-8", "surrogatepass")


def reasoning_text(item: Reasoning) -> str:
    """The reasoning history of a reasoning input item, what a chat backend is sent
    (:mod:`hotloop.backends.chat.render`) and what its token count counts
    (:func:`hotloop.pipeline.items.item_text`): its raw reasoning (the content parts joined as
    they were streamed, no separator), else the text its ``encrypted_content`` seals if this
    server sealed it (a token that does not open is ignored: the module's docstring), else its
    summary (its non-empty parts one a line), else nothing. A summary hotloop streamed is the
    model's reasoning verbatim, so the three agree for an item hotloop made; the token wins over
    the summary because it is the model's own text, where a summary may be any client's."""
    if item.content:
        raw = "".join(p.text for p in item.content)
        if raw:
            return raw
    token = item.encrypted_content
    if token:
        text = unseal(token)
        if text:
            return text
    if item.summary:
        return "\n".join(p.text for p in item.summary if p.text)
    return ""
