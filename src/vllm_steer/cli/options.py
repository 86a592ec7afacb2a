"""The flags every ``vllm-steer`` subcommand that talks to a server shares: ``--server`` (alias ``--url``),
``--api-key`` (default ``$VLLM_API_KEY``), and ``--model`` / ``--json`` where a command takes them."""

from __future__ import annotations

import argparse
import os

API_KEY_ENV = "VLLM_API_KEY"


def server_args(p: argparse.ArgumentParser, *, model: bool = False, json_output: bool = False) -> None:
    p.add_argument("--server", "--url", dest="server", required=True, metavar="URL",
                   help="the server's URL, e.g. http://127.0.0.1:8000")
    if model:
        p.add_argument("--model", help="the served model name (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None, metavar="KEY",
                   help=f"sent as a bearer token: vLLM's --api-key, or steer.api_key for registrations and "
                        f"deletions (default: ${API_KEY_ENV})")
    if json_output:
        p.add_argument("--json", action="store_true", help="print the server's JSON answer instead of a table")
