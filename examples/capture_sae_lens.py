"""Capture served traffic as an SAE training set: the filesystem consumer's ``format: "sae_lens"``
writes, per captured site, a Hugging Face ``datasets`` directory that sae-lens trains from as it is
(``use_cached_activations``), also readable with numpy alone.

The server's steer block: ``"capture": [{"name": "filesystem", "instance": "sae", "params": {"root":
ROOT, "tag": "sae", "format": "sae_lens", "context_size": 128}}]`` (pyarrow must be installed:
``pip install 'vllm-steer[sae_lens]'``). Whole windows of ``context_size`` tokens are written every
``shard_mb`` (default 64 MiB) or once they waited ``flush_s`` (default 10 s).

``python examples/capture_sae_lens.py BASE_URL ROOT [INSTANCE] [LAYER]`` sends a few prompts capturing
``post_mlp`` of LAYER at every position, waits until their whole windows are on disk, and reads them.
"""

import json
import sys
import time
from pathlib import Path

import numpy as np

from vllm_steer import Client

base_url, root = sys.argv[1], Path(sys.argv[2])
instance = sys.argv[3] if len(sys.argv) > 3 else "sae"
layer = int(sys.argv[4]) if len(sys.argv) > 4 else 3
site = root / instance / "sae_lens" / f"blocks.{layer}.hook_resid_post"  # {root}/{tag}/sae_lens/{sae-lens hook_name}

tokens = 0
with Client(base_url) as c:
    for prompt in ("The robot looked at the sea and", "Once upon a time", "The capital of France is"):
        r = c.complete(prompt, max_tokens=16, temperature=0, capture={
            instance: {"layers": [layer], "hooks": ["post_mlp"], "positions": "all"}})
        tokens += r.usage.prompt_tokens + r.usage.completion_tokens - 1  # the last token is never run

deadline = time.monotonic() + 120
while True:  # wait for the windows (the writer adds shards; a tail shorter than a window stays buffered)
    index = json.loads((site / "index.json").read_text()) if (site / "index.json").exists() else None
    if index and sum(s["windows"] for s in index["shards"]) * index["context_size"] > tokens - index["context_size"]:
        break
    assert time.monotonic() < deadline, f"windows of {tokens} tokens not written under {site}"
    time.sleep(0.2)

# numpy, two lines: index.json gives each arrow file's byte offset of its values
s = json.loads((site / "index.json").read_text())
acts = np.memmap(site / s["shards"][0]["file"], s["dtype"], "r", s["shards"][0]["offset"],
                 (s["shards"][0]["windows"], s["context_size"], s["d_in"]))
print(f"tokens captured: {tokens}")
print(f"windows: {sum(x['windows'] for x in s['shards'])} of {s['context_size']} tokens, d_in {acts.shape[2]}")

# sae-lens trains from the directory as it is:
#   LanguageModelSAERunnerConfig(..., hook_name=site.name, context_size=s["context_size"], d_in=s["d_in"],
#                                use_cached_activations=True, cached_activations_path=str(site))
# and datasets loads it: datasets.load_from_disk(str(site)).with_format("numpy")[0][site.name] -> [context, d_in]
