"""`tokenstream reload`: swap the served model of a running `tokenstream serve`, without downtime.

Asks the supervisor (POST /reload on its port, with the admin key) to load the model again, with
new weights when --model is given. Triton loads the new copy while the old one serves: streams open
on the old one finish, new requests go to the new one once it is ready, and a new model that fails
to load leaves the old one serving (the error comes back here, exit status 1). Memory: both copies
are resident during the swap.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from streaming_backend.configuration import endpoints
from streaming_backend.paths import admin_key_file
from streaming_backend.wire import ADMIN_HEADER, ADMIN_KEY_VARIABLE, CHAT_MODEL

DEFAULT_URL = endpoints.SUPERVISOR_URL
TIMEOUT_S = 900.0  # a big model can take minutes to load


@dataclass(frozen=True)
class ReloadConfig:
    """Which supervisor, which model, and the key."""

    url: str = DEFAULT_URL
    model: str | None = None  # new weights (HF directory, GGUF file, hub id); None: the same
    name: str = CHAT_MODEL  # the Triton model to reload
    admin_key: str | None = None  # None: $TOKENSTREAM_ADMIN_KEY, else the file serve wrote


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `tokenstream reload`."""
    parser.add_argument(
        "--url", default=DEFAULT_URL, help=f"the supervisor (default {DEFAULT_URL})"
    )
    parser.add_argument("--model", help="new weights: HF directory, GGUF file or hub id")
    parser.add_argument("--name", default=CHAT_MODEL, help=f"Triton model (default {CHAT_MODEL})")
    parser.add_argument(
        "--admin-key",
        help=f"default ${ADMIN_KEY_VARIABLE}, else the key file serve wrote for that port",
    )


def main(args: argparse.Namespace) -> int:
    """Entry point of `tokenstream reload` (parsed options)."""
    cfg = ReloadConfig(url=args.url, model=args.model, name=args.name, admin_key=args.admin_key)
    try:
        seconds = reload(cfg)
    except RuntimeError as error:
        print(f"tokenstream reload: {error}", file=sys.stderr)
        return 1
    print(f"tokenstream reload: {cfg.name} reloaded in {seconds:.1f} s")
    return 0


def reload(cfg: ReloadConfig) -> float:
    """Ask the supervisor to reload; the seconds it took. Raises RuntimeError on failure."""
    body = json.dumps({"model": cfg.model, "name": cfg.name}).encode()
    headers = {"Content-Type": "application/json", ADMIN_HEADER: _key(cfg)}
    request = urllib.request.Request(f"{cfg.url.rstrip('/')}/reload", data=body, headers=headers)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=TIMEOUT_S) as response:
            return float(json.loads(response.read())["seconds"])
    except urllib.error.HTTPError as error:
        raise RuntimeError(_message(error.read()) or f"HTTP {error.code}") from None
    except (urllib.error.URLError, OSError) as error:
        raise RuntimeError(f"no supervisor at {cfg.url}: {error}") from None


def _key(cfg: ReloadConfig) -> str:
    """The admin key: given, from the environment, else from serve's key file for the port."""
    key = cfg.admin_key or os.environ.get(ADMIN_KEY_VARIABLE)
    if key:
        return key
    port = urllib.parse.urlsplit(cfg.url).port or 80
    try:
        return admin_key_file(port).read_text().strip()
    except OSError:
        raise RuntimeError(
            f"no admin key: pass --admin-key, set ${ADMIN_KEY_VARIABLE}, or run this as the user "
            f"running serve ({admin_key_file(port)} not readable)"
        ) from None


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")
