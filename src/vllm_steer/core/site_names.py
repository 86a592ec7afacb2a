"""Site names: our ``hook.layer`` and TransformerLens / SAELens hook names, both parsed to ``(hook, layer)``.

A site is a hook point of a decoder layer (``core.hooks``). Wherever a site is named (request vector
keys, module file tensors, capture ``sites``, SAE ``site`` / ``sae_slots`` / manifest keys) either
spelling is accepted, mapped by this one table:

    ours           TransformerLens / SAELens      the residual stream ...
    pre_attn.L     blocks.L.hook_resid_pre        entering layer L
    post_attn.L    blocks.L.hook_resid_mid        after layer L's attention output is added
    post_mlp.L     blocks.L.hook_resid_post       leaving layer L (its output)

``L`` is a decimal layer index without sign, spaces or leading zeros. Only the residual-stream hooks
map to a site (``hook_attn_out``, ``hook_mlp_out``, ... do not). This module only parses names;
checking a site against a model (layer range, enabled hooks) is the caller's.
"""

from __future__ import annotations

import re
from typing import Any

from vllm_steer.core.hooks import HOOK_NAMES

TL_HOOKS: dict[str, str] = {"hook_resid_pre": "pre_attn", "hook_resid_mid": "post_attn", "hook_resid_post": "post_mlp"}
"""TransformerLens hook name (without ``blocks.L.``) -> our hook point."""

SITE_FORMS = (f"'hook.layer' with hook one of {', '.join(HOOK_NAMES)} (e.g. 'post_mlp.12'), "
              "or 'blocks.L.hook_resid_pre|mid|post' (TransformerLens)")
"""The accepted spellings, as error messages name them."""

_LAYER = re.compile(r"0|[1-9][0-9]*")


def _shown(value: Any) -> str:
    """A name in a message: its repr, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def tl_hook(name: str) -> str | None:
    """Our hook point for a TransformerLens hook name without its layer (``hook_resid_post`` ->
    ``post_mlp``); None for a name that is not a residual-stream hook."""
    return TL_HOOKS.get(name)


def parse_site_name(text: Any) -> tuple[str, int]:
    """``"post_mlp.12"`` or ``"blocks.12.hook_resid_post"`` -> ``("post_mlp", 12)``; ValueError saying
    what is wrong and naming the accepted forms otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"expected a site name, {SITE_FORMS}; got {type(text).__name__}")
    parts = text.split(".")
    if len(parts) == 3 and parts[0] == "blocks":
        layer, hook = parts[1], tl_hook(parts[2])
        if hook is None:
            raise ValueError(f"unknown hook {_shown(parts[2])} in {_shown(text)}: only the residual-stream "
                             f"hooks {', '.join(TL_HOOKS)} name a site")
    elif len(parts) == 2:
        hook, layer = parts
        if hook not in HOOK_NAMES:
            raise ValueError(f"unknown hook {_shown(hook)} in {_shown(text)}; expected {SITE_FORMS}")
    else:
        raise ValueError(f"expected {SITE_FORMS}; got {_shown(text)}")
    if not _LAYER.fullmatch(layer):
        raise ValueError(f"layer in {_shown(text)} must be a non-negative decimal integer without sign, "
                         "spaces or leading zeros")
    return hook, int(layer)
