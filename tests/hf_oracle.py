"""The reference no one here wrote: Hugging Face transformers on the same weights, with the steering
vector added by forward hooks at the same points, in float32: greedy-decoded, or (``check_greedy``) teacher-forced
on vLLM's tokens, the same check in one forward.

Hook points, defined on HF's layer structure (stream = residual stream):
- pre_attn at layer i: a forward pre-hook on layers[i] adds v to its input hidden states.
- post_attn: a forward hook adds v to the output of the module whose output is added to the
  residual after attention (``self_attn`` for Llama/Qwen/Mistral/Phi-3; Gemma's, OLMo-2/3's and EXAONE-4's
  ``post_attention_layernorm``, GLM-4's ``post_self_attn_layernorm``); Granite scales that output by
  ``residual_multiplier`` before the add, so its hook adds ``v / residual_multiplier``.
- post_mlp: a forward hook on layers[i] adds v to the layer's output.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

_POST_ATTN_MODULE = {"gemma2": "post_attention_layernorm", "gemma3": "post_attention_layernorm",
                     "glm4": "post_self_attn_layernorm", "olmo2": "post_attention_layernorm",
                     "olmo3": "post_attention_layernorm",
                     "exaone4": "post_attention_layernorm", "gemma4": "post_attention_layernorm",
                     "gemma4_moe": "post_attention_layernorm"}
_BRANCH_SCALE = {"granite": "residual_multiplier", "granitemoe": "residual_multiplier"}  # config attribute


@lru_cache(maxsize=4)
def load(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)


def _add(v: torch.Tensor):
    def out_hook(module, args, output):
        if isinstance(output, tuple):
            return (output[0] + v,) + tuple(output[1:])
        return output + v

    return out_hook


def _add_input(v: torch.Tensor):
    def pre_hook(module, args, kwargs):
        if args:
            return (args[0] + v,) + tuple(args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = kwargs["hidden_states"] + v
        return args, kwargs

    return pre_hook


def install_hooks(model, family: str, steer: dict[str, dict[int, np.ndarray]], device=None) -> list:
    """Forward (pre-)hooks that add each vector at its hook point; returns their handles."""
    handles = []
    layers = model.model.layers
    for hook, per_layer in steer.items():
        for layer, vec in per_layer.items():
            v = torch.as_tensor(np.asarray(vec), dtype=torch.float32, device=device)
            block = layers[int(layer)]
            if hook == "pre_attn":
                handles.append(block.register_forward_pre_hook(_add_input(v), with_kwargs=True))
            elif hook == "post_attn":
                target = getattr(block, _POST_ATTN_MODULE.get(family, "self_attn"))
                scale = getattr(model.config, _BRANCH_SCALE[family]) if family in _BRANCH_SCALE else 1.0
                handles.append(target.register_forward_hook(_add(v / scale)))
            elif hook == "post_mlp":
                handles.append(block.register_forward_hook(_add(v)))
            else:
                raise ValueError(hook)
    return handles


def _edit_output(fn):
    def out_hook(module, args, output):
        if isinstance(output, tuple):
            return (fn(output[0]),) + tuple(output[1:])
        return fn(output)

    return out_hook


def _edit_input(fn):
    def pre_hook(module, args, kwargs):
        if args:
            return (fn(args[0]),) + tuple(args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = fn(kwargs["hidden_states"])
        return args, kwargs

    return pre_hook


def install_edits(model, edits: list) -> list:
    """Hooks that replace the residual stream at (hook, layer) by ``fn(stream)``, in list order:
    pre_attn = a layer's input, post_mlp = its output (post_attn has no module boundary in HF); ``mlp``: ``fn`` is
    a forward hook on the layer's MLP (a transcoder's edit of its output)."""
    handles = []
    for hook, layer, fn in edits:
        block = model.model.layers[int(layer)]
        if hook == "mlp":
            handles.append(block.mlp.register_forward_hook(fn))
        elif hook == "pre_attn":
            handles.append(block.register_forward_pre_hook(_edit_input(fn), with_kwargs=True))
        elif hook == "post_mlp":
            handles.append(block.register_forward_hook(_edit_output(fn)))
        else:
            raise ValueError(f"no stream edit at {hook}")
    return handles


@torch.no_grad()
def streams(path: str, ids: list[int], family: str = "llama") -> dict[str, np.ndarray]:
    """``{"hook.layer": [T, D]}``: the residual stream of the prompt at each site (pre_attn: a layer's input;
    post_attn: that plus the output of the module hooked for post_attn, scaled as the model scales it; post_mlp:
    the layer's output)."""
    model, _ = load(path)
    scale = getattr(model.config, _BRANCH_SCALE[family]) if family in _BRANCH_SCALE else 1.0
    seen: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(module, args, kwargs, output=None):
            t = (args[0] if args else kwargs["hidden_states"]) if output is None else output
            seen[name] = (t[0] if isinstance(t, tuple) else t)[0].clone()
        return hook

    handles = []
    for i, block in enumerate(model.model.layers):
        handles.append(block.register_forward_pre_hook(keep(f"in.{i}"), with_kwargs=True))
        handles.append(block.register_forward_hook(
            lambda m, a, k, o, i=i: keep(f"post_mlp.{i}")(m, a, k, o), with_kwargs=True))
        branch = getattr(block, _POST_ATTN_MODULE.get(family, "self_attn"))
        handles.append(branch.register_forward_hook(
            lambda m, a, k, o, i=i: keep(f"branch.{i}")(m, a, k, o), with_kwargs=True))
    try:
        model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    out = {}
    for i in range(len(model.model.layers)):
        out[f"pre_attn.{i}"] = seen[f"in.{i}"].numpy()
        out[f"post_attn.{i}"] = (seen[f"in.{i}"] + scale * seen[f"branch.{i}"]).numpy()
        out[f"post_mlp.{i}"] = seen[f"post_mlp.{i}"].numpy()
    return out


@torch.no_grad()
def greedy(
    path: str,
    prompt_ids: list[int],
    max_tokens: int,
    steer: dict[str, dict[int, np.ndarray]] | None = None,
    family: str = "llama",
    edits: list | None = None,
) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs, full recompute each step (no cache: simplest to trust).
    ``edits``: (hook, layer, fn) stream edits applied before ``steer``'s vectors."""
    model, _ = load(path)
    handles = install_edits(model, edits or []) + install_hooks(model, family, steer or {})
    try:
        ids = list(prompt_ids)
        tokens, logprobs = [], []
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            lp = torch.log_softmax(logits, dim=-1)
            tok = int(torch.argmax(lp))
            tokens.append(tok)
            logprobs.append(float(lp[tok]))
            ids.append(tok)
        return tokens, logprobs
    finally:
        for h in handles:
            h.remove()


def check_greedy(got: dict, path: str, prompt_ids: list[int], max_tokens: int,
                 steer: dict[str, dict[int, np.ndarray]] | None = None, family: str = "llama",
                 edits: list | None = None, atol: float = 2e-3, what: object = "") -> None:
    """vLLM's greedy request ``got`` (``token_ids``, ``logprobs``) is transformers' greedy decode with the same
    vectors / edits: ``max_tokens`` tokens, each transformers' argmax after the ones before it, its logprob within
    ``atol``. Checked teacher-forced on vLLM's tokens, one forward instead of ``greedy``'s one per token: a sequence
    whose every token is its prefix's argmax is the greedy one, so it is the same check (an exact tie aside)."""
    tokens = got["token_ids"]
    assert len(tokens) == max_tokens, (what, tokens)
    ref = forced(path, prompt_ids, tokens, steer, family, edits)
    off = np.flatnonzero(ref["trail"] > 0)
    assert off.size == 0, (f"{what}: vLLM's token {off[0]} ({tokens[off[0]]}) trails transformers' argmax by "
                           f"{ref['trail'][off[0]]:.4g}; vLLM's tokens {tokens}")
    np.testing.assert_allclose(got["logprobs"], ref["logprobs"], atol=atol, err_msg=str(what))


def is_greedy(tokens: list[int], path: str, prompt_ids: list[int],
              steer: dict[str, dict[int, np.ndarray]] | None = None, family: str = "llama",
              edits: list | None = None) -> bool:
    """Whether ``tokens`` are transformers' greedy decode with these vectors / edits (teacher-forced, as
    ``check_greedy``): ``not is_greedy(...)`` is ``tokens != greedy(...)[0]`` in one forward."""
    return bool((forced(path, prompt_ids, tokens, steer, family, edits)["trail"] == 0).all())


@torch.no_grad()
def forced(path: str, prompt_ids: list[int], tokens: list[int], steer: dict[str, dict[int, np.ndarray]] | None = None,
           family: str = "llama", edits: list | None = None) -> dict[str, np.ndarray]:
    """Teacher-forced on ``prompt_ids + tokens`` (one forward, ``edits`` then ``steer``'s vectors by hooks): per
    token, its logprob (``logprobs``) and how far its logit trails the top one (``trail``, 0 where it is the argmax)."""
    model, _ = load(path)
    handles = install_edits(model, edits or []) + install_hooks(model, family, steer or {})
    try:
        return teacher_forced(model, prompt_ids, tokens)
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def teacher_forced(model, prompt_ids: list[int], tokens: list[int]) -> dict[str, np.ndarray]:
    """``forced``'s result from ``model`` as it is (its hooks already installed)."""
    logits = model(torch.tensor([list(prompt_ids) + list(tokens)])).logits[0].float()
    at = logits[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(tokens)]
    idx = torch.tensor(tokens)[:, None]
    return {"logprobs": torch.log_softmax(at, dim=-1).gather(1, idx)[:, 0].numpy(),
            "trail": (at.max(dim=-1).values - at.gather(1, idx)[:, 0]).numpy()}


def pair_text_ids(tok, pair: dict, side: str, chat: bool) -> list[int]:
    """The token ids extraction sends for one side of a pair, built with transformers: prompt +
    completion as is, or chat-templated (a user turn; with a prompt, the answer continued)."""
    if not chat:
        return tok((pair.get("prompt") or "") + pair[side])["input_ids"]
    if pair.get("prompt"):
        msgs = [{"role": "user", "content": pair["prompt"]}, {"role": "assistant", "content": pair[side]}]
        text = tok.apply_chat_template(msgs, continue_final_message=True, tokenize=False)
    else:
        text = tok.apply_chat_template([{"role": "user", "content": pair[side]}], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]  # as vLLM tokenizes a rendered chat


@torch.no_grad()
def mean_diff_of_last_tokens(path: str, pairs: list[dict], chat: bool, layers: list[int]) -> dict[str, np.ndarray]:
    """``{"pre_attn.L" | "post_mlp.L": mean over pairs of (positive - negative) last-token residual}``
    from ``output_hidden_states`` (pre_attn.L: the input of layer L; post_mlp.L: its output)."""
    model, tok = load(path)
    diffs: dict[str, list[np.ndarray]] = {}
    for pair in pairs:
        hs = {side: model(torch.tensor([pair_text_ids(tok, pair, side, chat)]), output_hidden_states=True).hidden_states
              for side in ("positive", "negative")}
        for hook, shift in (("pre_attn", 0), ("post_mlp", 1)):
            for layer in layers:
                d = hs["positive"][layer + shift][0, -1] - hs["negative"][layer + shift][0, -1]
                diffs.setdefault(f"{hook}.{layer}", []).append(d.double().numpy())
    return {site: np.mean(ds, axis=0) for site, ds in diffs.items()}
