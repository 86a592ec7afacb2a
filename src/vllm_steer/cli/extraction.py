"""``vllm-steer extract``: contrastive pairs -> a module file (and optionally a registered module), read from
a running server; ``calibrate``: each site's typical residual norm (what ``"norm"`` strengths are relative
to) -> a JSON file; ``sweep``: prompts x strengths -> a table and plot of where the text breaks."""

from __future__ import annotations

import argparse
import sys

from vllm_steer.cli.calls import check_server
from vllm_steer.cli.options import server_args
from vllm_steer.extract import ExtractError, extract
from vllm_steer.extract import calibrate as calibration
from vllm_steer.extract import sweep as sweeping
from vllm_steer.extract.files import file_kind
from vllm_steer.extract.methods import METHODS
from vllm_steer.extract.pairs import read_jsonl, read_two_files

FEW_PAIRS = 3  # fewer pairs than this: extract warns (the vector is still written)


def _extract_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("extract", help="steering vectors from contrastive pairs, read from a running server",
                       description="Send each side of each pair through the server (its 'activations' capture "
                                   "consumer must be enabled: steer.capture: [\"activations\"]) and write one "
                                   "vector per hook and layer.")
    server_args(p, model=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--pairs", help='JSONL: {"positive": ..., "negative": ...[, "prompt": ...]} per line')
    src.add_argument("--positive", help="a file of positive texts, one per line (with --negative)")
    p.add_argument("--negative", help="a file of negative texts, line i pairing with --positive's line i")
    p.add_argument("--layers", default="all", help="all (default), N, A-B (inclusive) or a comma list")
    p.add_argument("--hooks", default="post_mlp", help="comma list of pre_attn, post_attn, post_mlp or TransformerLens' hook_resid_pre|mid|post (default post_mlp)")
    p.add_argument("--method", choices=METHODS, default="mean_diff", help="mean_diff (CAA, default) or pca (repeng)")
    p.add_argument("--reduce", choices=("last", "mean"), default="last",
                   help="the last token's residual (default) or the mean over the text")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template (server side)")
    p.add_argument("--normalize", action="store_true", help="scale each vector to unit norm")
    p.add_argument("--emit", choices=("add", "ablate"), default="add",
                   help="add (default: a module adding the vectors) or ablate (a module removing each direction "
                        "from the stream, e.g. a refusal direction; .safetensors; the server needs "
                        "steer.max_projections >= 1)")
    p.add_argument("-o", "--output", required=True, help="the module file: .safetensors or .gguf (post_mlp only)")
    p.add_argument("--register", metavar="NAME", help="also register it on the server as module NAME")
    p.add_argument("--replace", action="store_true", help="with --register: replace a module of that name")


def _calibrate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="each site's typical residual norm, for 'norm' strengths",
                       description="Send each prompt through the server's 'activations' capture consumer and write, "
                                   "per site, the mean L2 norm of the residual at the last prompt token: the file "
                                   "steer.site_norms and module registrations (site_norms) read.")
    server_args(p, model=True)
    p.add_argument("--prompts", help="a file of prompts, one per line (default: 16 built-in prompts)")
    p.add_argument("--layers", default="all", help="all (default), N, A-B (inclusive) or a comma list")
    p.add_argument("--hooks", default="post_mlp", help="comma list of pre_attn, post_attn, post_mlp (default post_mlp)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template (server side)")
    p.add_argument("-o", "--output", required=True, help="the norms file to write (.json)")


def run_calibrate(args: argparse.Namespace) -> int:
    prompts = calibration.read_prompts(args.prompts) if args.prompts else None
    check_server(args)
    obj = calibration.calibrate(args.server, prompts, layers=args.layers, chat=args.chat, model=args.model,
                                api_key=args.api_key, hooks=[h.strip() for h in args.hooks.split(",") if h.strip()],
                                progress=_progress)
    path = calibration.write(obj, args.output)
    print(f"wrote {path}: typical residual norms of {len(obj['site_norms'])} sites over {obj['texts']} prompts",
          file=sys.stderr)
    return 0


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ExtractError(f"--strengths: expected a comma list of numbers, got {text!r}") from None


def _sweep_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="prompts x strengths -> a table and plot of where the text breaks",
                       description="Generate greedily at each strength and score it (vllm_steer.extract.sweep: "
                                   "fluency = the steered text's mean log-prob under the unsteered model, shift = "
                                   "the unsteered text's under the steered model, distinct = distinct-token ratio).")
    server_args(p, model=True)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--module", help="a registered module's name")
    what.add_argument("--vectors", help="a .safetensors module file, sent inline (norm needs steer.site_norms)")
    p.add_argument("--unit", choices=sweeping.UNITS, default="norm",
                   help="norm (default: a fraction of each site's typical residual norm) or scale")
    p.add_argument("--strengths", default="0,0.05,0.1,0.2,0.4,0.8", help="comma list (default 0,0.05,0.1,0.2,0.4,0.8)")
    p.add_argument("--prompts", help="a file of prompts, one per line (default: 4 of calibrate's prompts)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per completion (default 32)")
    p.add_argument("-o", "--output", required=True, help="the output prefix: writes PREFIX.csv, PREFIX.md, PREFIX.png")


def run_sweep(args: argparse.Namespace) -> int:
    prompts = calibration.read_prompts(args.prompts) if args.prompts else list(calibration.PROMPTS[:4])
    vectors = sweeping.vectors_from_file(args.vectors) if args.vectors else None
    check_server(args)
    cells = sweeping.sweep(args.server, prompts, _floats(args.strengths), unit=args.unit, module=args.module,
                           vectors=vectors, max_tokens=args.max_tokens, model=args.model, api_key=args.api_key)
    paths = sweeping.write(cells, args.unit, args.output)
    print(paths["md"].read_text(), end="")
    written = ", ".join(str(p) for p in paths.values())
    print(f"wrote {written} (the plot: fluency blue, shift orange above; distinct grey below)", file=sys.stderr)
    return 0


def _progress(done: int, total: int) -> None:
    if done == total or done % max(1, total // 20) == 0:
        print(f"\ractivations: {done}/{total} requests", end="\n" if done == total else "", file=sys.stderr, flush=True)


def run_extract(args: argparse.Namespace) -> int:
    if args.positive and not args.negative:
        raise ExtractError("--positive needs --negative")
    if file_kind(args.output) == "gguf" and args.emit == "ablate":
        raise ExtractError("--emit ablate writes .safetensors (project.<site> tensors): a GGUF control vector is "
                           "added by llama.cpp and repeng")
    pairs = read_jsonl(args.pairs) if args.pairs else read_two_files(args.positive, args.negative)
    check_server(args)
    if 0 < len(pairs) < FEW_PAIRS:
        print(f"vllm-steer extract: warning: {len(pairs)} pair{'s' * (len(pairs) != 1)} only: such a vector is mostly "
              "the pair's own wording, not the concept; use several (CAA and repeng use tens to hundreds)",
              file=sys.stderr)
    result = extract(args.server, pairs, layers=args.layers,
                     hooks=[h.strip() for h in args.hooks.split(",") if h.strip()], method=args.method,
                     reduce=args.reduce, chat=args.chat, normalize=args.normalize, model=args.model,
                     api_key=args.api_key, progress=_progress, emit=args.emit)
    path = result.save(args.output)
    n = sum(len(per) for per in result.vectors.values())
    print(f"wrote {path}: {n} {'directions to ablate' if args.emit == 'ablate' else 'vectors'} ({', '.join(sorted(result.vectors))}; {result.method} over "
          f"{result.pairs} pairs, {result.info['seconds']} s)", file=sys.stderr)
    if args.register:
        summary = result.register(args.server, args.register, api_key=args.api_key, replace=args.replace)
        print(f"registered module {summary.name!r}", file=sys.stderr)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> dict:
    """The subcommands' parsers added to ``sub``; their runners by name."""
    _extract_parser(sub)
    _calibrate_parser(sub)
    _sweep_parser(sub)
    return {"extract": run_extract, "calibrate": run_calibrate, "sweep": run_sweep}
