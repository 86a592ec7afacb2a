"""How the listing commands (``sites``, ``modules``, ``sae``) ask a server: through ``vllm_steer.Client`` (typed
answers, ``client_types``), with an answer that is not vllm-steer's (no such route: a server without the plugin; a
body that is not the JSON the route documents, which the Client refuses to decode) turned into a ``CliError`` that
says so, never a traceback."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from vllm_steer.cli.refusals import CliError
from vllm_steer.client_types import Status
from vllm_steer.http_client import Client, SteeringAPIError

TIMEOUT_S = 120.0


def client(args: argparse.Namespace) -> Client:
    return Client(args.server, api_key=args.api_key, timeout=getattr(args, "timeout", TIMEOUT_S))


def timeout_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=float, default=TIMEOUT_S, metavar="S",
                   help=f"seconds to wait for the server's answer (default {TIMEOUT_S:g})")


def ask(args: argparse.Namespace, route: str, call: Callable[[Client], Any]) -> Any:
    """``call(client)``'s typed answer (``route`` names it in errors)."""
    with client(args) as c:
        try:
            return call(c)
        except SteeringAPIError as e:
            if e.status == 404 and e.param is None:  # vLLM's own 404, not one of the plugin's (they name a param)
                raise CliError(f"{args.server} has no {route} (it answered {e.status}): is it a vLLM server "
                               "started with the vllm-steer plugin (VLLM_PLUGINS=steer)? (--server)") from None
            raise
        except (TypeError, KeyError, ValueError, AttributeError) as e:  # the Client's decoding of the body
            raise garbage(args, route, f"{type(e).__name__}: {e}") from None


def check_server(args: argparse.Namespace) -> Status:
    """The status route's answer (``GET /v1/steering``), once the server answered it, runs vllm-steer with
    steering on and answered as documented; else the ``CliError`` that says which. ``sites`` shows it;
    extract, calibrate and sweep ask it first, so a wrong ``--server`` is named before any real work."""
    route = "GET /v1/steering"
    status = ask(args, route, lambda c: c.status())
    if not status.enabled:
        raise CliError(f"steering is off on {args.server}: start it with --additional-config "
                       "'{\"steer\": {...}}' (and without \"enabled\": false) (--server)")
    if status.model is None:
        raise garbage(args, route, "model: expected the served model's sites, got null")
    return status


def garbage(args: argparse.Namespace, route: str, what: str) -> CliError:
    return CliError(f"{args.server} answered {route} with something that is not vllm-steer's answer ({what}); "
                    "is --server a vllm-steer server?")


def rendered(args: argparse.Namespace, route: str, render: Callable[[], str]) -> str:
    """``render()``, a field of unexpected type in the answer named as the server's, not raised as a bug."""
    try:
        return render()
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        raise garbage(args, route, f"{type(e).__name__}: {e}") from None
