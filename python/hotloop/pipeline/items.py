"""Per-item analysis: the semantic fingerprint and the token count of one conversation item.

The fingerprint is taken over the item's *semantic* view (what a model would see: role, texts,
call ids, arguments), not over its wire bytes, so an item the client echoes back in a slightly
different spelling (with or without ``id``/``status``, content as a string or as parts) matches
the item the server produced. Token counts come from the shared tokenizer and are cached by
fingerprint in a bounded LRU (:class:`TokenCache`), so a client that resends its whole history
over HTTP pays for hashing, not for tokenizing.

A fingerprint is 16 bytes: keyed BLAKE2b (:class:`hotloop._accel.Fingerprinter`) of the view's
canonical JSON. The key is secret and one per process: the deployment's (:func:`use_key`, set by
the engine from its store, :mod:`hotloop.state.fpkey`), so nobody can craft two items with one
fingerprint to poison the caches that trust fingerprint equality.

Nesting is bounded at ``MAX_DEPTH`` containers. The bound is checked when an item's (or a
setting's) token count is not cached, i.e. just before it is tokenized: a cached fingerprint
belongs to content that passed the check, and the walk costs less than the tokenizing it
precedes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable

import msgspec

from hotloop import _accel, errors, tokenizer
from hotloop.protocol.request import (
    MAX_NESTING,
    nests_deeper,
    FunctionCall,
    FunctionCallOutput,
    InputFile,
    InputImage,
    InputText,
    Item,
    ItemReference,
    Message,
    OtherItem,
    OutputText,
    Reasoning,
    ReasoningText,
    Refusal,
    SummaryText,
    model_view,
)
from hotloop.protocol.sealed import reasoning_text
from hotloop.state import fpkey
from hotloop.state.context import ITEM_OVERHEAD, held_extra
from hotloop.state.store import LEGACY_OWNER

# The canonical form: compact JSON with sorted keys, by msgspec. A Cython canonicaliser measured
# no faster on what a turn encodes (per call, ns, Cython vs msgspec: a 300 B message 200 vs 214, a
# 2 KB function_call_output 700 vs 900, a function_call 222 vs 127, a 1.2 KB tool schema 3,400 vs
# 1,630, re-encoded every turn; a turn with 15 tools 52 vs 27 us), so there is none.
_canonical = msgspec.json.Encoder(order="sorted").encode
_fingerprint = _accel.Fingerprinter(fpkey.PROCESS_KEY)

MAX_DEPTH = MAX_NESTING  # most nested containers (arrays, objects) in an item's view or a tool definition


def use_key(key: bytes) -> None:
    """Fingerprint under ``key`` from now on (the deployment's secret; 16 to 64 bytes)."""
    global _fingerprint
    _fingerprint = _accel.Fingerprinter(key)


def too_deep(obj: Any) -> bool:
    """Whether ``obj`` nests more than ``MAX_DEPTH`` containers."""
    return nests_deeper(obj, MAX_DEPTH)


def _part_view(part: Any) -> list[Any]:
    t = type(part)
    if t is InputText or t is OutputText or t is ReasoningText or t is SummaryText:
        return ["t", part.text]
    if t is Refusal:
        return ["r", part.refusal]
    if t is InputImage:
        return ["i", part.image_url or "", part.file_id or "", part.detail]
    if t is InputFile:
        return ["f", part.file_id or "", part.file_url or "", part.filename or "", part.file_data or ""]
    return ["o", msgspec.to_builtins(part)]


def _content_view(content: str | list[Any]) -> list[Any]:
    if isinstance(content, str):
        return [["t", content]]
    return [_part_view(p) for p in content]


def semantic_view(item: Item) -> list[Any]:
    """What identifies an item for prefix matching (ids and statuses are not part of it)."""
    t = type(item)
    if t is Message:
        return ["m", item.role, _content_view(item.content)]  # type: ignore[union-attr,arg-type]
    if t is FunctionCall:
        return ["fc", item.call_id, item.name, item.arguments]  # type: ignore[union-attr]
    if t is FunctionCallOutput:
        return ["fo", item.call_id, _content_view(item.output)]  # type: ignore[union-attr]
    if t is Reasoning:
        r: Reasoning = item  # type: ignore[assignment]
        return [
            "rs",
            [s.text for s in r.summary],
            [c.text for c in r.content or ()],
            r.encrypted_content or "",
        ]
    if t is ItemReference:
        return ["ref", item.id]  # type: ignore[union-attr]
    o: OtherItem = item  # type: ignore[assignment]
    data = {k: v for k, v in o.data.items() if k not in ("id", "status")}
    return ["x", o.type, data]


def _content_text(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    out = []
    for p in content:
        text = getattr(p, "text", None)
        if text is None:
            text = getattr(p, "refusal", None)
        if text:
            out.append(text)
    return "\n".join(out)


def item_text(item: Item) -> str:
    """The text a chat template would render for this item (its token count is what we bill)."""
    t = type(item)
    if t is Message:
        return _content_text(item.content)  # type: ignore[union-attr,arg-type]
    if t is FunctionCall:
        return f"{item.name}({item.arguments})"  # type: ignore[union-attr]
    if t is FunctionCallOutput:
        return _content_text(item.output)  # type: ignore[union-attr]
    if t is Reasoning:
        # exactly the text the backend is sent (backends.chat.render): raw content, else the
        # text its encrypted_content seals (if this server sealed it), else its summary
        return reasoning_text(item)  # type: ignore[arg-type]
    if t is OtherItem:
        return _canonical(model_view(item.data)).decode()  # type: ignore[union-attr]
    return ""


_TOO_DEEP = f"nested too deeply (at most {MAX_DEPTH} levels of arrays and objects)"


def _item_too_deep(param: str) -> errors.InvalidValue:
    return errors.InvalidValue(f"Invalid '{param}': an item is {_TOO_DEEP}.", param=param)


def _tool_too_deep() -> errors.InvalidValue:
    return errors.InvalidValue(f"Invalid 'tools': a tool definition is {_TOO_DEEP}.", param="tools")


def _encode_view(view: list[Any], param: str) -> bytes:
    try:
        return _canonical(view)
    except RecursionError:
        raise _item_too_deep(param) from None


def canonical(item: Item, param: str = "input") -> bytes:
    """The canonical JSON of an item's semantic view: what its fingerprint hashes, and (by its
    length) the approximate size in bytes of its content (:attr:`Context.nbytes`).

    :raises errors.InvalidValue: the view nests more than ``MAX_DEPTH`` containers.
    """
    view = semantic_view(item)
    data = _encode_view(view, param)
    if too_deep(view):
        raise _item_too_deep(param)
    return data


def fingerprint(item: Item, param: str = "input") -> bytes:
    """The item's fingerprint (its depth is checked where it is tokenized: :func:`split`)."""
    return _fingerprint(_encode_view(semantic_view(item), param))


class TokenCache:
    """fingerprint -> token count, LRU-bounded by entries (default 100,000 items).

    Not bounded by bytes because every entry has the same small size (a 16- or 17-byte key and an int
    value in an ordered dict, about 130 bytes): 100,000 entries are about 13 MB whatever the items
    held.

    Scoped by owner (:meth:`view`): a count one API key's request put here is found only by
    requests of the same key. A count found skips tokenizing the item (about 30 us per KB), so a
    cache shared by all keys would let one key learn, by timing its requests, whether another key
    sent a given text recently (as prompt caches are scoped per organisation for the same reason).
    """

    # Whether an earlier reasoning item counts: the backend is sent it (the Cerebras dialect puts
    # it back on its assistant message). The OpenAI-compatible dialect sends no reasoning history
    # (hotloop.backends.chat.render), so there a reasoning item is 0 tokens of the input: counted,
    # it took room in the context window (a follow-up that fits refused, truncation dropping real
    # items) for text the backend never sees. Set by the engine from its backend's dialect.
    counts_reasoning = True

    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self._d: OrderedDict[bytes, int] = OrderedDict()
        self._tag = b""  # the owner's key prefix (empty: the open mode's one owner)
        self._stats = [0, 0]  # hits, misses: shared by the views of one cache

    @property
    def hits(self) -> int:
        return self._stats[0]

    @hits.setter
    def hits(self, n: int) -> None:
        self._stats[0] = n

    @property
    def misses(self) -> int:
        return self._stats[1]

    @misses.setter
    def misses(self, n: int) -> None:
        self._stats[1] = n

    def view(self, owner: str) -> "TokenCache":
        """The cache as ``owner`` sees it: its own counts only (the same entries, bound and
        statistics). The open mode's owner (every request of a server without keys) keeps
        unprefixed keys."""
        if owner == LEGACY_OWNER:
            return self
        v = TokenCache.__new__(TokenCache)
        v.max_entries = self.max_entries
        v._d = self._d
        owner_bytes = owner.encode()
        v._tag = len(owner_bytes).to_bytes(2, "big") + owner_bytes  # length first: no owner's prefix is another's
        v._stats = self._stats
        v.counts_reasoning = self.counts_reasoning
        return v

    def __len__(self) -> int:
        return len(self._d)

    def get(self, fp: bytes) -> int | None:
        key = self._tag + fp if self._tag else fp
        v = self._d.get(key)
        if v is not None:
            self._d.move_to_end(key)
            self._stats[0] += 1
        return v

    def put(self, fp: bytes, tokens: int) -> None:
        d = self._d
        key = self._tag + fp if self._tag else fp
        d[key] = tokens
        d.move_to_end(key)
        if len(d) > self.max_entries:
            d.popitem(last=False)


def split(
    items: Iterable[Item], cache: TokenCache | None = None
) -> tuple[list[bytes], list[int], list[tuple[int, str]], list[int]]:
    """Fingerprints, cached token counts (0 where unknown), the ``(index, text)`` still to count,
    and item sizes in bytes for :attr:`Context.nbytes` (the length of the canonical JSON the
    fingerprint hashes, plus ``ITEM_OVERHEAD`` and what the decoded item holds beyond its JSON,
    :func:`hotloop.state.context.held_extra`: no second encoding).

    A reasoning item is 0 tokens where the cache says the backend is not sent reasoning
    (:attr:`TokenCache.counts_reasoning`).

    :raises errors.InvalidValue: an item whose count is not cached nests too deeply.
    """
    skip = Reasoning if cache is not None and not cache.counts_reasoning else None
    fps: list[bytes] = []
    toks: list[int] = []
    sizes: list[int] = []
    missing: list[tuple[int, str]] = []
    overhead = ITEM_OVERHEAD
    fingerprint = _fingerprint
    for i, item in enumerate(items):
        view = semantic_view(item)
        data = _encode_view(view, f"input[{i}]")
        fp = fingerprint(data)
        n: int | None
        if type(item) is skip:
            n = 0  # not sent to this backend (TokenCache.counts_reasoning)
        else:
            n = cache.get(fp) if cache is not None else None
        if n is None:
            if too_deep(view):
                raise _item_too_deep(f"input[{i}]")
            missing.append((i, item_text(item)))
            n = 0
        fps.append(fp)
        toks.append(n)
        sizes.append(len(data) + overhead + held_extra(item))
    return fps, toks, missing, sizes


def count_texts(texts: list[str]) -> list[int]:
    """Token counts of item texts, per-item overhead included. Thread-safe (tokenizer only)."""
    per_item = tokenizer.TOKENS_PER_ITEM
    return [tokenizer.count(t) + per_item for t in texts]


def fill(
    fps: list[bytes], toks: list[int], missing: list[tuple[int, str]], counts: list[int], cache: TokenCache | None
) -> None:
    """Put ``counts`` (for ``missing``) into ``toks`` and the cache."""
    for (i, _), n in zip(missing, counts):
        toks[i] = n
        if cache is not None:
            cache.misses += 1
            cache.put(fps[i], n)


def analyze(items: Iterable[Item], cache: TokenCache | None = None) -> tuple[list[bytes], list[int], list[int]]:
    """Fingerprints, token counts and sizes of ``items`` (tokenizing only what the cache lacks)."""
    fps, toks, missing, sizes = split(items, cache)
    if missing:
        fill(fps, toks, missing, count_texts([t for _, t in missing]), cache)
    return fps, toks, sizes


_SETTING = b"s"


def blob_split(obj: Any, cache: TokenCache | None = None) -> tuple[int, str | None, bytes]:
    """A setting the model sees each turn (instructions text, one tool's schema): its cached token
    count, or the text still to count; and its fingerprint. -> ``(count, text_or_None, fp)``.

    :raises errors.InvalidValue: a tool definition whose count is not cached nests too deeply.
    """
    if isinstance(obj, str):
        data = obj.encode()
    else:
        try:
            data = _canonical(obj)
        except RecursionError:
            raise _tool_too_deep() from None
    # One byte more than an item's fingerprint (split): a setting never finds an item's count in
    # the cache they share, nor an item a setting's (instructions spelled as an item's JSON
    # changed that item's count, for every request of the key)
    fp = _SETTING + _fingerprint(data)
    n = cache.get(fp) if cache is not None else None
    if n is None:
        if isinstance(obj, str):
            return 0, obj, fp  # the text itself: no decode of its encoding
        if too_deep(obj):
            raise _tool_too_deep()
        return 0, data.decode(), fp
    return n, None, fp


def count_pending(item_texts: list[str], blob_texts: list[str]) -> tuple[list[int], list[int]]:
    """Counts for pending item texts and setting texts. Thread-safe (tokenizer only)."""
    return count_texts(item_texts), [tokenizer.count(t) for t in blob_texts]
