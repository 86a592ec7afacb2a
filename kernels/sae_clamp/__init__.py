"""sae_clamp: SAE feature clamping of the residual stream, per token row (delta and reconstruct).

The plain-torch references (``naive.py``, ``packed.py``: the spec and the CPU path), the tensor-core kernels of full
packs (``full_triton.py``, ``full_slot.py``) and the token-tiled clamps of clamp-only packs at prefill sizes
(``tiled_triton.py``); the decode-size clamp walk lives in the steered norm's kernel. See README.md."""
