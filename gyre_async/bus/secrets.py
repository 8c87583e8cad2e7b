"""Secrets in bus URLs: redacted wherever a URL is shown, expanded only to connect.

A Kafka bus URL may carry a password (``sasl_plain_password=...``, ``ssl_password=...``).
Three rules keep it off disk, out of logs and out of other users' ``ps``:

- **Redact what is shown.** :func:`redact` replaces every secret's value in any text (a URL,
  a log line, a JSON document) with :data:`REDACTED`; ``config.json``, reports, log lines
  and metrics labels go through it. A ``${NAME}`` reference is kept as it is: it names the
  secret, it does not hold it.
- **Name secrets by environment variable.** ``sasl_plain_password=${GYRE_KAFKA_PASSWORD}``
  in a URL is expanded by :func:`expand` when the bus is built (:func:`gyre_async.bus.open_bus`)
  and nowhere else, so the expanded value never reaches a file, a log or an argument list.
- **Hand secrets to child processes by environment.** :func:`externalize` turns a URL's
  literal secrets into references and returns the variables to set, so ``gyre launch``
  passes children a URL that names its secrets and the secrets themselves in the
  environment (readable by the same user only, unlike ``/proc/<pid>/cmdline``).

A redacted URL cannot connect: :func:`expand_query` refuses it with an error that says where the
real secret must come from, instead of sending the placeholder to the broker.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from urllib.parse import parse_qsl, unquote_plus

#: Query parameters of a bus URL whose values are secrets (the rest are shown as they are).
SECRET_KEYS = ("sasl_plain_password", "ssl_password")
#: What a redacted secret reads as (URL-safe, so a redacted URL still parses).
REDACTED = "REDACTED"

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_REFERENCE = re.compile(r"\$\{(" + _NAME + r")\}")
_ONLY_REFERENCE = re.compile(r"\$\{" + _NAME + r"\}")
# key=value inside a query string, JSON, a log line or an argv: the value runs to the next
# character that ends a value in any of those forms (erring towards hiding too much)
_SECRET_PARAM = re.compile(r"(?P<key>\b(?:" + "|".join(SECRET_KEYS) + r"))="
                           r"(?P<value>[^&\s\"'<>#\\]*)")
# scheme://user:password@host: the password part
_USERINFO = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@\"']*):(?P<value>[^@\s/\"']*)@")


def _hide(value: str) -> str:
    """A secret's value as shown: a ``${NAME}`` reference stays, anything else is redacted."""
    return value if (_ONLY_REFERENCE.fullmatch(value) or value == REDACTED) else REDACTED


def redact(text: str) -> str:
    """``text`` with the value of every URL secret in it replaced by :data:`REDACTED`.

    Works on a bare URL and on any text that quotes one (a log line, JSON, an error
    message), so callers need not know where a URL hides.
    """
    if "=" not in text and "@" not in text:
        return text
    text = _SECRET_PARAM.sub(lambda m: f"{m['key']}={_hide(m['value'])}", text)
    return _USERINFO.sub(lambda m: f"{m['head']}:{_hide(m['value'])}@", text)


def has_literal_secret(url: str) -> bool:
    """True when ``url`` holds a secret's value (not only ``${NAME}`` references)."""
    return redact(url) != url


def expand(value: str, environ: Mapping[str, str] | None = None) -> str:
    """``value`` with each ``${NAME}`` replaced by the environment variable ``NAME``; an
    unset variable is a ``ValueError`` that names it (never a value)."""
    env = os.environ if environ is None else environ

    def lookup(match: re.Match) -> str:
        name = match[1]
        if name not in env:
            raise ValueError(f"the bus URL names ${{{name}}}, which is not set: export {name} "
                             "with the secret in the environment of every gyre process")
        return env[name]

    return _REFERENCE.sub(lookup, value)


def expand_query(query: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A bus URL's query as connection options, references expanded (:func:`expand`).

    Called only when the bus is built. A secret that was redacted when a run recorded its
    config is refused: sending the placeholder to the broker would fail later and less
    clearly.
    """
    options = {}
    for key, value in parse_qsl(query):
        if key in SECRET_KEYS and value == REDACTED:
            raise ValueError(
                f"the bus URL's {key} is redacted (recorded configs and reports never keep "
                "a secret): name it as ${VARIABLE} in the URL and export the variable, or "
                "pass the real URL with --bus or $GYRE_BUS")
        options[key] = expand(value, environ)
    return options


def externalize(url: str, prefix: str = "GYRE_BUS_") -> tuple[str, dict[str, str]]:
    """(``url`` with its literal secrets replaced by ``${PREFIX<KEY>}`` references, the
    variables to set in a child's environment so that :func:`expand` gets them back).

    Values are stored decoded (as the URL parser hands them to the bus), so a
    percent-encoded password round-trips.
    """
    env: dict[str, str] = {}

    def swap(match: re.Match) -> str:
        key, value = match["key"], match["value"]
        if _ONLY_REFERENCE.fullmatch(value):
            return match[0]
        name = prefix + key.upper()
        env[name] = unquote_plus(value)
        return f"{key}=${{{name}}}"

    return _SECRET_PARAM.sub(swap, url), env
