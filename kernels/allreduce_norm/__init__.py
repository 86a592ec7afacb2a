"""One-shot all-reduce + residual add + RMSNorm in one launch across TP ranks (issue 40's give-back C)."""
