"""``vllm-steer sae list``: the SAEs a server's requests may clamp (``GET /v1/steering/sae``: ``steer.sae`` and
those registered at runtime) and its sites reserved for runtime SAEs."""

from __future__ import annotations

import argparse
import json

from vllm_steer.cli.calls import ask, rendered, timeout_arg
from vllm_steer.cli.options import server_args
from vllm_steer.cli.tables import table
from vllm_steer.client_types import SaeList

ROUTE = "GET /v1/steering/sae"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sae", help="the SAEs requests may clamp", description=f"SAEs ({ROUTE}).")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="{list}")
    v = verbs.add_parser("list", help="the SAEs requests may clamp, and the sites reserved for runtime ones")
    server_args(v, json_output=True)
    timeout_arg(v)
    v.set_defaults(run=run_list)


def render(body: SaeList) -> str:
    rows = [[e.name, e.source, ", ".join(e.sites), e.d_sae, e.activation, e.clampable, ", ".join(e.modes),
             e.in_flight] for e in body.data]
    out = [table(["name", "source", "sites", "d_sae", "activation", "clampable", "modes", "in_flight"], rows)
           if rows else "no SAEs on this server (steer.sae, or POST /v1/steering/sae)"]
    for s in body.slots:
        out.append(f"site {s.site} reserved for runtime SAEs ({s.clampable} features): "
                   f"{'held by ' + s.sae if s.sae else 'free'}")
    return "\n".join(out)


def run_list(args: argparse.Namespace) -> int:
    body = ask(args, ROUTE, lambda c: c.saes())
    print(json.dumps(body.as_dict(), indent=2) if args.json else rendered(args, ROUTE, lambda: render(body)))
    return 0
