"""``vllm-steer modules list | show NAME | register NAME FILE | delete NAME``: a server's named steering modules
(``/v1/steering/modules``) from the shell, through ``vllm_steer.Client``."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from vllm_steer.cli.calls import ask, rendered, timeout_arg
from vllm_steer.cli.options import server_args
from vllm_steer.cli.refusals import REGISTER_FLAGS, CliError
from vllm_steer.cli.tables import fields, layer_ranges, table
from vllm_steer.client_types import Module
from vllm_steer.core.hooks import HOOK_NAMES
from vllm_steer.http_client import SteeringAPIError

ROUTE = "/v1/steering/modules"
TIERS = {"steering_vectors": "all", "prefill_steering_vectors": "prefill", "decode_steering_vectors": "decode"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("modules", help="list, show, register or delete a server's named steering modules",
                       description=f"Named steering modules ({ROUTE}): requests name one with "
                                   '{"steering_module": {"name": NAME, "scale": 0.5}} (or "norm").')
    verbs = p.add_subparsers(dest="verb", required=True, metavar="{list,show,register,delete}")

    def verb(name: str, run, help: str) -> argparse.ArgumentParser:
        v = verbs.add_parser(name, help=help, description=help)
        server_args(v, json_output=True)
        timeout_arg(v)
        v.set_defaults(run=run)
        return v

    verb("list", run_list, "the registered modules: their sites, tiers, size and requests using them")
    verb("show", run_show, "one module: its description, tiers, sites, norms, projections").add_argument(
        "name", metavar="NAME")
    reg = verb("register", run_register, "register a module file (.safetensors, .gguf or .json) as NAME")
    reg.add_argument("name", metavar="NAME", help="1 to 128 letters, digits, '-', '_' or '.'")
    reg.add_argument("file", metavar="FILE", help="what vllm-steer extract writes (.safetensors / .gguf), a GGUF "
                                                  "control vector, or a .json of the registration's fields")
    reg.add_argument("--replace", action="store_true", help="replace a module of that name (else refused)")
    reg.add_argument("--description", help="a description (default: the file's own)")
    reg.add_argument("--site-norms", metavar="NORMS", help="a vllm-steer calibrate file: the typical residual "
                                                           "norms its 'norm' strengths read (default: the file's own)")
    reg.add_argument("--as-ablation", action="store_true",
                     help="its vectors become directions ablated at their sites (it then adds nothing)")
    reg.set_defaults(flags=REGISTER_FLAGS)  # the server's params named as these arguments in its refusals
    verb("delete", run_delete, "delete a module (requests already using it finish with it)").add_argument(
        "name", metavar="NAME")


def _get(args: argparse.Namespace, call):
    try:
        return ask(args, ROUTE, call)
    except SteeringAPIError as e:
        if e.status == 404 and e.param == "name":
            raise CliError(f"NAME: {e.message} (vllm-steer modules list shows the registered ones)") from None
        raise


def _grouped(sites: list) -> str:
    """``["post_mlp.3", "post_mlp.4", "pre_attn.7"]`` -> ``"post_mlp 3-4; pre_attn 7 (3 sites)"``."""
    hooks: dict[str, list[int]] = {}
    for site in sites:
        hook, layer = str(site).rsplit(".", 1)
        hooks.setdefault(hook, []).append(int(layer))
    plural = "s" * (len(sites) != 1)
    return "; ".join(f"{h} {layer_ranges(ls)}" for h, ls in hooks.items()) + f" ({len(sites)} site{plural})"


def _sites(info: Module) -> list[tuple[str, str]]:
    """Per tier, its sites (``post_mlp 10-20 (11 sites)``), then per projection field its sites and modes; from
    hooks x layers where the server lists no sites (an older server)."""
    out = [(f"sites ({TIERS.get(t, t)})", _grouped(sites)) for t, sites in info.sites.items()]
    if not info.sites and info.hooks:
        out = [("sites", f"{', '.join(info.hooks)} at layers {layer_ranges(info.layers)}")]
    for field, per_site in (info.projections or {}).items():
        modes = sorted({m for ms in per_site.values() for m in ms})
        tier = TIERS.get(field.replace("projections", "vectors"), field)
        out.append((f"projections ({tier})", f"{_grouped(list(per_site))}: {', '.join(modes)}"))
    return out or [("sites", "none")]


def _extras(info: Module) -> list[str]:
    return [x for x, on in (("norms", info.site_norms), ("condition", info.condition),
                            ("projections", info.projections)) if on]


def _residual_order(hook: str) -> tuple[int, str]:
    return (HOOK_NAMES.index(hook) if hook in HOOK_NAMES else len(HOOK_NAMES), hook)


def render_list(data: list[Module]) -> str:
    if not data:
        return "no modules registered (vllm-steer modules register NAME FILE)"
    rows = [[m.name, ", ".join(sorted(m.hooks, key=_residual_order)), layer_ranges(m.layers),
             ", ".join(TIERS.get(t, t) for t in m.tiers), m.bytes, m.in_flight, ", ".join(_extras(m)),
             m.description] for m in data]
    return table(["name", "hooks", "layers", "tiers", "bytes", "in_flight", "carries", "description"], rows)


def render_show(m: Module) -> str:
    norms = m.site_norms or {}
    created = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(m.created))
    pairs = [("name", m.name), ("description", m.description), ("source", m.source),
             ("version", m.version), ("created", created), *_sites(m), ("bytes", m.bytes),
             ("in_flight", m.in_flight),
             ("site_norms", ", ".join(f"{k} {v:.4g}" for k, v in norms.items()) or "none (the server's)"),
             ("condition", json.dumps(m.condition) if m.condition else None)]
    return fields(pairs)


def run_list(args: argparse.Namespace) -> int:
    data = _get(args, lambda c: c.modules())
    print(json.dumps([m.as_dict() for m in data], indent=2) if args.json
          else rendered(args, ROUTE, lambda: render_list(data)))
    return 0


def run_show(args: argparse.Namespace) -> int:
    info = _get(args, lambda c: c.module(args.name))
    print(json.dumps(info.as_dict(), indent=2) if args.json else rendered(args, ROUTE, lambda: render_show(info)))
    return 0


def run_register(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        raise CliError(f"FILE: no such file: {args.file}")
    norms = None
    if args.site_norms:
        try:
            norms = json.loads(Path(args.site_norms).read_text())
        except OSError as e:
            raise CliError(f"--site-norms: cannot read {args.site_norms} ({e.strerror or e})") from None
        except ValueError as e:
            raise CliError(f"--site-norms: {args.site_norms} is not JSON ({e})") from None
    info = _get(args, lambda c: c.register_module(args.name, file=str(path), replace=args.replace,
                                                  description=args.description, site_norms=norms,
                                                  as_ablation=args.as_ablation))
    if args.json:
        print(json.dumps(info.as_dict(), indent=2))
    else:
        where = "; ".join(f"{k} {v}" for k, v in rendered(args, ROUTE, lambda: _sites(info)))
        print(f"registered module {info.name!r} ({where}; {info.bytes} bytes); a request names it as "
              f'{{"steering_module": {{"name": "{info.name}", "scale": 1.0}}}}')
    return 0


def run_delete(args: argparse.Namespace) -> int:
    body = _get(args, lambda c: c.delete_module(args.name))
    print(json.dumps(body.as_dict()) if args.json else f"deleted module {body.deleted!r}")
    return 0
