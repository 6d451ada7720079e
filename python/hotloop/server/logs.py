"""Logging: the text format, or JSON (``--log-format json``): one object per line for every
record, uvicorn's access and error logs included, and one line per response (logger
``hotloop.response``) with its request id, key name, model, transport, status, tokens and stage
timings in milliseconds."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hotloop.server.engine import Run

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
response_log = logging.getLogger("hotloop.response")


class JsonFormatter(logging.Formatter):
    """A record as one JSON object: time, level, logger, message, extra fields, the traceback."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def startup_error(fmt: str, message: str, prefix: str = "") -> None:
    """One start-up error line on stderr, before logging is set up (a setting refused): a JSON
    object under ``--log-format json``, as every later line is; else ``prefix`` and ``message``."""
    if fmt == "json":
        record = logging.LogRecord("hotloop.server", logging.ERROR, "", 0, message, None, None)
        line = JsonFormatter().format(record)
    else:
        line = prefix + message
    print(line, file=sys.stderr)


def log_config(level: str, fmt: str) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for the server and uvicorn (``uvicorn.Config(log_config=...)``)."""
    formatter: dict[str, Any] = (
        {"()": "hotloop.server.logs.JsonFormatter"} if fmt == "json" else {"format": TEXT_FORMAT}
    )
    handler = {"class": "logging.StreamHandler", "formatter": "default", "stream": "ext://sys.stderr"}
    lvl = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": formatter},
        "handlers": {"default": handler},
        "root": {"handlers": ["default"], "level": lvl},
        "loggers": {
            "uvicorn": {"handlers": [], "level": lvl, "propagate": True},
            "uvicorn.error": {"handlers": [], "level": lvl, "propagate": True},
            "uvicorn.access": {"handlers": [], "level": lvl, "propagate": True},
        },
    }


def stage_ms(run: "Run") -> dict[str, float]:
    """The response's stage durations in milliseconds (hotloop.server.metrics.STAGES)."""
    from hotloop.server.metrics import STAGES

    m = run.marks
    out = {name: round((t - prev) * 1e3, 3) for name, prev, t in zip(STAGES, m, m[1:])}
    if len(m) == 7 and run.ended:
        out["persist"] = round((run.ended - m[6]) * 1e3, 3)
    return out


def log_response(run: "Run") -> None:
    """One line per finished response."""
    response = run.turn.response
    usage = response.get("usage") or {}
    fields = {
        "request_id": run.request_id,
        "response_id": response.get("id"),
        "key": run.tenant.name,
        "model": response.get("model"),
        "transport": run.turn.transport,
        "status": response.get("status"),
        "input_tokens": usage.get("input_tokens"),
        "output_tokens": usage.get("output_tokens"),
        "cached_tokens": (usage.get("input_tokens_details") or {}).get("cached_tokens"),
        "stages_ms": stage_ms(run),
    }
    response_log.info("response %s", response.get("status"), extra={"fields": fields})
