"""Worker-side data plane: steering tables, row allocation, op installation, per-step token index."""
