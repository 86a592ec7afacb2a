"""Capture residuals and read them back: the filesystem consumer writes every prompt position of two
sites to files under its root (on the server's machine), ``load_request`` reads them; the built-in
``activations`` consumer returns the last token's residual in the response itself.

``python examples/capture_read_back.py BASE_URL FS_ROOT [FS_INSTANCE]`` (the server's steer block:
``"capture": [{"name": "filesystem", "instance": "fs", "params": {"root": FS_ROOT}}, "activations"]``).
"""

import sys

from vllm_steer import Client, decode_activations, load_request

base_url, root = sys.argv[1], sys.argv[2]
fs = sys.argv[3] if len(sys.argv) > 3 else "fs"

with Client(base_url) as c:
    r = c.complete("The robot looked at the sea and", max_tokens=4, temperature=0, capture={
        fs: {"layers": [3, 10], "hooks": ["post_mlp"], "positions": "all_prompt"},
        "activations": {"layers": [3, 10], "hooks": ["post_mlp"], "positions": "last_prompt"}})
    files = load_request(root, f"{r.id}-0")  # (layer, hook) -> (positions, rows [n, hidden])
    last = decode_activations(r.capture["activations"])  # "post_mlp.3" -> [hidden]
    for (layer, hook), (positions, rows) in sorted(files.items()):
        same = bool((rows[-1] == last[f"{hook}.{layer}"]).all())
        print(f"{hook}.{layer}: {rows.shape[0]} positions x {rows.shape[1]} from files; last row equals the response's: {same}")
