"""sae_clamp: SAE feature clamping of the residual stream, per token row (delta and reconstruct).

Only the plain-torch reference exists so far (the spec the Triton kernel will be tested against and the
CPU implementation); see README.md and NOTES.md ("SAE clamping") for what is still to be built."""
