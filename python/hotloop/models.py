"""The model registry: each model's context window, output limit and tokenizer.

Three sources, the first that says something about a field wins (field by field):

1. **Overrides** from a JSON file (``--model-limits FILE`` / ``HOTLOOP_MODEL_LIMITS``)::

       {"my-model": {"context_window": 32768, "max_output_tokens": 4096, "tokenizer": "o200k_base"},
        "*": {"context_window": 8192}}

   ``"*"`` applies to every model nothing else describes; a field set to ``null`` removes the
   bundled value (no check for it).
2. **What the backend reports**: an OpenAI-compatible server's ``GET /models`` entry with
   ``max_model_len`` (vLLM's field; also read: ``context_window``, ``context_length``).
3. **The bundled table** below.

A model none of them knows has no limits: no window check. Limits are looked up once per
response (two dict look-ups); nothing here does I/O after start-up.

Counting: hotloop counts every model with the shipped o200k_base vocabulary
(:mod:`hotloop.tokenizer`). ``tokenizer`` records the model's own tokenizer name:
``o200k_harmony`` (the gpt-oss models) has o200k_base's ranks plus special tokens, so ordinary
text counts the same; for other families the count is an estimate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Mapping

O200K_BASE = "o200k_base"
O200K_HARMONY = "o200k_harmony"
TOKENIZERS = (O200K_BASE, O200K_HARMONY)
WILDCARD = "*"

_FIELDS = ("context_window", "max_output_tokens", "tokenizer")


@dataclass(frozen=True)
class ModelLimits:
    """What the server knows about one model (``None``: unknown, not checked)."""

    context_window: int | None = None  # input plus output tokens the model accepts
    max_output_tokens: int | None = None  # tokens one response may generate
    tokenizer: str = O200K_BASE


NO_LIMITS = ModelLimits()

# The bundled table. Values are the documented windows of the models as Cerebras Cloud serves them
# (the catalogue changes: query GET /v1/models, and override per deployment).
BUNDLED: dict[str, ModelLimits] = {
    # 131,072 tokens of context: OpenRouter's gpt-oss-120b page and Cerebras' paid tiers (the free
    # tier allows 65,536: override with --model-limits there); up to 32,768 output tokens
    # (Cerebras model list as reported by Bifrost's model library: "131K context, 33K max output").
    "gpt-oss-120b": ModelLimits(131_072, 32_768, O200K_HARMONY),
    # gpt-oss-20b shares the 131,072-token window (OpenAI's gpt-oss model card).
    "gpt-oss-20b": ModelLimits(131_072, None, O200K_HARMONY),
    # Gemma 4 31B on Cerebras: 65K tokens on the free tier, 131K on paid tiers (NeuroLink's
    # Cerebras provider guide, verified against /v1/models in Aug 2026); the output limit is not
    # documented there.
    "gemma-4-31b": ModelLimits(131_072, None, O200K_BASE),
}


class ModelLimitsError(ValueError):
    """An unreadable or malformed model-limits file (start-up fails, saying why)."""


def _tokenizer_for(model: str) -> str:
    # the id's last path segment: vLLM serves gpt-oss as "openai/gpt-oss-120b" by default
    return O200K_HARMONY if model.rsplit("/", 1)[-1].lower().startswith("gpt-oss") else O200K_BASE


def _parse_entry(model: str, raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ModelLimitsError(f"model limits for {model!r}: expected an object")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in _FIELDS:
            raise ModelLimitsError(f"model limits for {model!r}: unknown field {key!r} (known: {', '.join(_FIELDS)})")
        if key == "tokenizer":
            if value not in TOKENIZERS:
                raise ModelLimitsError(f"model limits for {model!r}: tokenizer must be one of {', '.join(TOKENIZERS)}")
        elif value is not None and (type(value) is not int or value < 1):
            raise ModelLimitsError(f"model limits for {model!r}: {key} must be a positive integer or null")
        out[key] = value
    return out


def parse_overrides(data: Any) -> dict[str, dict[str, Any]]:
    """A model-limits document (``{model: {field: value}}``) as validated field maps."""
    if not isinstance(data, dict):
        raise ModelLimitsError("model limits: expected a JSON object of model ids")
    return {str(model): _parse_entry(str(model), raw) for model, raw in data.items()}


def load_overrides(path: str) -> dict[str, dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelLimitsError(f"cannot read model limits from {path}: {exc}") from None
    return parse_overrides(data)


def reported_window(model: Mapping[str, Any]) -> int | None:
    """The context window a backend's ``/models`` entry reports (vLLM: ``max_model_len``)."""
    for key in ("max_model_len", "context_window", "context_length"):
        v = model.get(key)
        if type(v) is int and v > 0:
            return v
    return None


class ModelRegistry:
    """Limits per model id: overrides, then what the backend reported, then the bundled table."""

    def __init__(
        self,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
        bundled: Mapping[str, ModelLimits] | None = None,
    ) -> None:
        self.overrides = {k: dict(v) for k, v in (overrides or {}).items()}
        self.bundled = dict(BUNDLED if bundled is None else bundled)
        self._cache: dict[tuple[str, int | None], ModelLimits] = {}

    @classmethod
    def from_config(cls, path: str | None) -> "ModelRegistry":
        return cls(load_overrides(path) if path else None)

    def get(self, model: str, reported: Mapping[str, int] | None = None) -> ModelLimits:
        """The limits of ``model``; ``reported`` maps model ids to the windows the backend reported."""
        window = reported.get(model) if reported else None
        key = (model, window)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        limits = self.bundled.get(model)
        if limits is None:
            limits = replace(NO_LIMITS, tokenizer=_tokenizer_for(model))
            wild = self.overrides.get(WILDCARD)
            if wild:
                limits = replace(limits, **wild)
        if window is not None:
            limits = replace(limits, context_window=window)
        own = self.overrides.get(model)
        if own:
            limits = replace(limits, **own)
        if len(self._cache) < 4096:
            self._cache[key] = limits
        return limits
