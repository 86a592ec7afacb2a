"""The steering hook points: their names and order, shared by every layer of the plugin."""

from enum import Enum


class HookPoint(str, Enum):
    """Where in a decoder layer the residual stream is read or steered.

    - ``pre_attn``: the residual stream entering the layer.
    - ``post_attn``: after the attention output is added to the residual.
    - ``post_mlp``: the layer's output residual (after the MLP output is added).
    """

    PRE_ATTN = "pre_attn"
    POST_ATTN = "post_attn"
    POST_MLP = "post_mlp"


HOOK_NAMES: tuple[str, ...] = tuple(h.value for h in HookPoint)


def receiving_layer(hook: str, layer: int) -> int:
    """The decoder layer whose norm receives a site (``runtime.families``): ``pre_attn.L`` and
    ``post_attn.L`` layer L's, ``post_mlp.L`` layer L+1's input norm (the model's final norm, counted
    as layer ``num_layers``, for the last layer). Under pipeline parallelism the site lives on the
    stage that holds that layer."""
    return layer + 1 if hook == HookPoint.POST_MLP.value else layer


def site_order(hook: str, layer: int) -> int:
    """The position of a site in the forward pass: ``pre_attn.L < post_attn.L < post_mlp.L < pre_attn.L+1``
    (conditional steering compares a request's sites with its probe site by it)."""
    return 3 * layer + HOOK_NAMES.index(hook)
