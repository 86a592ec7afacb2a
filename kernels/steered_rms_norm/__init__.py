"""steered_rms_norm: vLLM's fused residual add + RMSNorm with steering rows added to the stream."""
