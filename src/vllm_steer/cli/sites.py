"""``vllm-steer sites``: the sites a server can steer (hook points x layers), read from its status route
(``GET /v1/steering``: ``model.hooks`` and ``num_layers``, narrowed by ``config.layers``), with the SAE sites
and whether ``norm`` strengths have server-wide norms."""

from __future__ import annotations

import argparse
import json

from vllm_steer.cli.calls import check_server, rendered, timeout_arg
from vllm_steer.cli.options import server_args
from vllm_steer.cli.tables import layer_ranges, table
from vllm_steer.client_types import Status
from vllm_steer.core.site_names import TL_HOOKS

ROUTE = "GET /v1/steering"
TL_NAMES = {ours: tl for tl, ours in TL_HOOKS.items()}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sites", help="the hook points and layers a server can steer",
                       description=f"The sites requests and modules may name ({ROUTE}): each hook point enabled "
                                   "on the server, at each layer steer.layers allows (default: all).")
    server_args(p, json_output=True)
    timeout_arg(p)
    p.set_defaults(run=run)


def sites_of(status: Status) -> dict:
    """The status route's answer -> ``{hooks, layers, sites, hidden_size, dtype, sae, sae_slots, site_norms}``."""
    model, cfg = status.model, status.config or {}
    layers = sorted(int(l) for l in (cfg.get("layers") or range(model.num_layers)))
    hooks = list(model.hooks)
    return {"num_layers": model.num_layers, "hidden_size": model.hidden_size, "dtype": model.dtype,
            "hooks": hooks, "layers": layers, "sites": [f"{h}.{l}" for h in hooks for l in layers],
            "sae": {name: e.get("site") for name, e in (cfg.get("sae") or {}).items()},
            "sae_slots": dict(cfg.get("sae_slots") or {}), "site_norms": bool(cfg.get("site_norms"))}


def render(s: dict) -> str:
    rows = [[h, f"blocks.L.{TL_NAMES.get(h, '?')}", layer_ranges(s["layers"]), len(s["layers"])] for h in s["hooks"]]
    lines = [table(["hook", "TransformerLens", "layers", "sites"], rows), "",
             f"{len(s['sites'])} sites of {s['num_layers']} layers; vectors have {s['hidden_size']} values "
             f"({s['dtype']}); name a site hook.layer (post_mlp.12) or blocks.12.hook_resid_post"]
    if s["sae"] or s["sae_slots"]:
        saes = [f"{name} at {site}" for name, site in s["sae"].items()]
        saes += [f"{site} reserved for runtime SAEs ({n if isinstance(n, int) else n['features']} features)"
                 for site, n in s["sae_slots"].items()]
        lines.append(f"SAE: {'; '.join(saes)} (vllm-steer sae list)")
    lines.append("norm strengths: server-wide norms (steer.site_norms)" if s["site_norms"] else
                 "norm strengths: no server-wide norms, only modules' own (vllm-steer calibrate writes them)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    status = check_server(args)
    s = rendered(args, ROUTE, lambda: sites_of(status))
    print(json.dumps(s, indent=2) if args.json else rendered(args, ROUTE, lambda: render(s)))
    return 0
