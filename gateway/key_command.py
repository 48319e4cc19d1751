"""``sluice keys add NAME [...]`` and ``sluice keys hash``: make API keys and their config entries.

``keys add`` prints a new key once, on the first line of stdout (it is stored nowhere: only its
SHA-256 goes into the config), then the ``api_keys`` entry to paste under ``auth:`` (or into
the ``SLUICE_API_KEYS_FILE`` list; ``--append FILE`` appends it there). ``keys hash`` reads an
existing key on stdin and prints its ``key_sha256``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from gateway.auth import key_sha256, new_key
from gateway.config import ApiKeyConfig

# (flag, ApiKeyConfig field, type, help) of the optional fields ``keys add`` takes.
_FIELD_FLAGS = (
    ("--priority", "priority", int, "priority of its requests that name none (lower is more urgent)"),
    ("--max-priority", "max_priority", int, "the most urgent priority its requests may ask"),
    ("--weight", "weight", float, "its share of a bucket by tokens when tenants compete (default 1)"),
    ("--requests-per-minute", "requests_per_minute", int, "quota: requests a minute"),
    ("--tokens-per-minute", "tokens_per_minute", int, "quota: prompt + generated tokens a minute"),
    ("--max-concurrent-requests", "max_concurrent_requests", int, "quota: requests in flight"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``add`` and ``hash`` to the ``keys`` command's ``parser``."""
    commands = parser.add_subparsers(dest="keys_command", required=True)
    add = commands.add_parser("add", help="make a new API key: print it once, and its config entry (hash only)")
    add.add_argument("name", help="the tenant's name (log field, metric label, fair-share key)")
    add.add_argument("--models", help="comma-separated model and adapter ids it may use (default: all)")
    for flag, _, kind, help_text in _FIELD_FLAGS:
        add.add_argument(flag, type=kind, help=help_text)
    add.add_argument("--append", type=Path, help="also append the entry to this keys file (a YAML list)")
    add.set_defaults(func=run_add)
    hash_command = commands.add_parser("hash", help="read a key on stdin, print its key_sha256")
    hash_command.set_defaults(func=run_hash)


def entry_for(key: str, args: argparse.Namespace) -> ApiKeyConfig:
    """The validated ``api_keys`` entry of ``key`` with the options of ``args``.

    Raises:
        ValidationError: a name or option the config would refuse.
    """
    fields: dict[str, Any] = {"name": args.name, "key_sha256": key_sha256(key)}
    if args.models is not None:
        fields["models"] = [m.strip() for m in args.models.split(",") if m.strip()]
    for _, field_name, _, _ in _FIELD_FLAGS:
        if getattr(args, field_name) is not None:
            fields[field_name] = getattr(args, field_name)
    return ApiKeyConfig.model_validate(fields)


def entry_yaml(entry: ApiKeyConfig) -> str:
    """``entry`` as one YAML list item (the fields set, ``name`` first), ending in a newline."""
    text: str = yaml.safe_dump([entry.model_dump(exclude_unset=True)], sort_keys=False)
    return text


def run_add(args: argparse.Namespace) -> int:
    """Print a new key, then its entry; 0, or 2 for an option the config would refuse."""
    key = new_key()
    try:
        entry = entry_for(key, args)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        print(f"sluice: {problems}", file=sys.stderr)
        return 2
    text = entry_yaml(entry)
    print(key)
    print("# The key above is shown once and stored nowhere. Its entry, for auth.api_keys or the keys file:")
    print(text, end="")
    if args.append is not None:
        existing = args.append.read_text() if args.append.exists() else ""
        with args.append.open("a") as out:
            out.write(("" if not existing or existing.endswith("\n") else "\n") + text)
        print(f"# appended to {args.append}; reload with SIGHUP or POST /admin/keys/reload", file=sys.stderr)
    return 0


def run_hash(args: argparse.Namespace) -> int:
    """Print the ``key_sha256`` of the key on stdin (its first line); 2 for an empty one."""
    key = sys.stdin.readline().strip()
    if not key:
        print("sluice: no key on stdin", file=sys.stderr)
        return 2
    print(key_sha256(key))
    return 0
