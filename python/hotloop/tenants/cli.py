"""``hotloop keys create|list|revoke|rotate`` and ``hotloop usage``: on the configured store directly.

They read the same ``--store``/``--data-dir`` flags and ``HOTLOOP_*`` environment as ``serve`` and
work whether or not a server is running (SQLite in WAL mode; a running server sees a new key at
once and a revocation within about a second). ``keys create`` and ``keys rotate`` print the new
secret alone on stdout (shown once); everything else a command says goes to stderr, except the
tables.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any, Sequence

from hotloop.config import Config
from hotloop.errors import StoreUnavailable
from hotloop.tenants.keys import InvalidKeyName, KeyExists, KeyStore, Limits, open_key_store


def _store_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", choices=["sqlite", "memory", "redis"], help="the store (env HOTLOOP_STORE, default sqlite)")
    p.add_argument("--data-dir", dest="data_dir", help="where the SQLite store lives (env HOTLOOP_DATA_DIR)")
    p.add_argument("--redis-url", dest="redis_url", help="redis://HOST:PORT/DB for --store redis (env HOTLOOP_REDIS_URL)")


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:  # (argparse would say "invalid _positive value")
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n <= 0 or n > 2**63 - 1:  # what the key stores hold (SQLite's INTEGER)
        raise argparse.ArgumentTypeError("must be a positive integer below 2**63")
    return n


def add_commands(sub: Any) -> None:
    """Register ``keys`` and ``usage`` on the ``hotloop`` command's subparsers."""
    k = sub.add_parser("keys", help="API keys: create, list, revoke, rotate (on the configured store)")
    ks = k.add_subparsers(dest="keys_command", required=True)
    c = ks.add_parser("create", help="create a key and print its secret (shown once)")
    c.add_argument("name", help="1-64 letters, digits, '.', '_' or '-'")
    c.add_argument("--rpm", type=_positive, help="requests per minute (default unlimited)")
    c.add_argument("--tpm", type=_positive, help="tokens per minute, input plus output (default unlimited)")
    c.add_argument("--max-concurrent", dest="max_concurrent", type=_positive, help="responses in flight at once")
    _store_flags(c)
    ls = ks.add_parser("list", help="names, limits, created, last used (never secrets)")
    _store_flags(ls)
    r = ks.add_parser("revoke", help="revoke a key (its next request fails with 401)")
    r.add_argument("name")
    _store_flags(r)
    ro = ks.add_parser(
        "rotate",
        help="give a key a new secret (printed once) and retire the old one; the key stays the same "
        "tenant: its stored responses, usage and limits",
    )
    ro.add_argument("name")
    _store_flags(ro)
    u = sub.add_parser("usage", help="the usage ledger: responses and tokens per day, model and key")
    u.add_argument(
        "--key", help="only the keys of this name (every key that had it: a revoked key's name may be given to a new key) or this key id"
    )
    u.add_argument("--since", type=date.fromisoformat, help="from this UTC day on (YYYY-MM-DD)")
    _store_flags(u)


def _config(args: argparse.Namespace) -> Config:
    return Config.from_env(store=args.store, data_dir=args.data_dir, redis_url=args.redis_url)


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(t))


def _limit(n: int | None) -> str:
    return "-" if n is None else str(n)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def _keys(args: argparse.Namespace, keys: KeyStore) -> int:
    cmd = args.keys_command
    if cmd == "create":
        try:
            _, secret = keys.create(args.name, Limits(args.rpm, args.tpm, args.max_concurrent))
        except (KeyExists, InvalidKeyName) as exc:
            print(f"hotloop keys: {exc}", file=sys.stderr)
            return 1
        print(secret)
        print(f"created key {args.name!r}; the secret above is shown only once", file=sys.stderr)
        return 0
    if cmd == "list":
        rows = [
            (
                k.name, _limit(k.limits.rpm), _limit(k.limits.tpm), _limit(k.limits.max_concurrent),
                _when(k.created_at), _when(k.last_used), "active" if k.active else f"revoked {_when(k.revoked_at)}",
            )
            for k in keys.list()
        ]
        print(table(("NAME", "RPM", "TPM", "CONCURRENT", "CREATED", "LAST USED", "STATUS"), rows))
        return 0
    if cmd == "revoke":
        if not keys.revoke(args.name):
            print(f"hotloop keys: no active key named {args.name!r}", file=sys.stderr)
            return 1
        print(f"revoked key {args.name!r}", file=sys.stderr)
        return 0
    if cmd == "rotate":
        rotated = keys.rotate(args.name)
        if rotated is None:
            print(f"hotloop keys: no active key named {args.name!r}", file=sys.stderr)
            return 1
        print(rotated)
        print(
            f"rotated key {args.name!r}; the secret above is shown only once, and the old one is refused "
            "within about a second (open WebSocket connections too, on their next response.create)",
            file=sys.stderr,
        )
        return 0
    return 2


def _key_ids(key: str, config: Config) -> list[str]:
    """The key ids ``hotloop usage --key KEY`` lists: ``KEY`` as an id, the id of every key
    (revoked ones included) named ``KEY``, and the legacy id of rows written under that name
    before the ledger recorded key ids (:func:`~hotloop.state.store.legacy_key_id`)."""
    from hotloop.state.store import legacy_key_id

    keys = open_key_store(config.store, config.db_path, config.redis_url)
    try:
        named = [k.id for k in keys.list() if k.name == key]
    finally:
        keys.close()
    return list(dict.fromkeys([key, *named, legacy_key_id(key)]))


def _usage(args: argparse.Namespace, config: Config) -> int:
    from hotloop.server.runner import make_store
    from hotloop.state.fpkey import KeyFileError

    ids: list[str | None] = [None] if args.key is None else [*_key_ids(args.key, config)]
    try:
        store = make_store(config, serving=False)  # (it reads: a read-only file will do)
    except KeyFileError as exc:
        print(f"hotloop usage: {exc}", file=sys.stderr)
        return 1
    since = args.since.isoformat() if args.since else None
    try:
        rows = [r for kid in ids for r in store.usage(kid, since)]
    finally:
        store.close()
    rows.sort(key=lambda r: (r["day"], r["model"], r["key_id"]))  # the ledger's order, over the ids asked
    cols = ("day", "key", "model", "responses", "input_tokens", "output_tokens", "cached_tokens", "reasoning_tokens", "key_id")
    print(table([c.upper() for c in cols], [[r[c] for c in cols] for r in rows]))
    return 0


_LOCKED = (
    "the store's SQLite file is locked by another connection (a server's long write, a backup, an "
    "open sqlite3 shell); nothing was changed, try again"
)


def run(args: argparse.Namespace) -> int:
    from hotloop.state.store import StoreBusy, locked

    config = _config(args)
    try:
        return _run(args, config)
    except BrokenPipeError:
        # the reader stopped (``| head``): not the store's failure; quiet, as CLIs are (stdout
        # pointed at /dev/null so that the interpreter's own flush at exit does not fail again)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except StoreBusy:  # the usage listing's move of an earlier version's rows, locked out
        print(f"hotloop {args.command}: {_LOCKED}", file=sys.stderr)
        return 1
    except StoreUnavailable as exc:
        from hotloop.state.redis_store import RedisVersionError

        from hotloop.backends.chat.http1 import redact_url

        # (the URL's password is not printed: redis://:secret@host is the usual form)
        why = exc.message if isinstance(exc, RedisVersionError) else f"the store at {redact_url(config.redis_url)} is unreachable"
        print(f"hotloop {args.command}: {why}", file=sys.stderr)
        return 1
    except (OSError, sqlite3.Error, ValueError) as exc:  # a data dir or database it cannot use, a malformed --redis-url
        if locked(exc):  # past the busy timeout (the key store's BUSY_TIMEOUT, 10 s; the response store's, 5 s)
            print(f"hotloop {args.command}: {_LOCKED}", file=sys.stderr)
            return 1
        print(f"hotloop {args.command}: cannot open the store: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace, config: Config) -> int:
    if config.store == "memory":
        print(f"hotloop {args.command}: needs a persistent store: --store sqlite (the default) or redis", file=sys.stderr)
        return 2
    reads = args.command == "usage" or args.keys_command != "create"
    if config.store == "sqlite" and reads and not Path(config.db_path).exists():
        # (opening it would create an empty store there, and its fingerprint key, and answer as
        # if nothing had been recorded: a mistyped --data-dir must not look like an empty ledger)
        print(
            f"hotloop {args.command}: no store at {config.db_path} (check --data-dir / HOTLOOP_DATA_DIR; "
            "`hotloop keys create` and `hotloop serve` create it)",
            file=sys.stderr,
        )
        return 1
    if args.command == "usage":
        return _usage(args, config)
    keys = open_key_store(config.store, config.db_path, config.redis_url)
    try:
        return _keys(args, keys)
    finally:
        keys.close()
