"""Extraction end to end: contrastive pairs -> a steering vector (difference of means of the last
token's residual, read by the server's ``activations`` capture consumer) -> a module file and a
registered module -> a steered completion. The strength is a ``norm``: a fraction of each steered site's typical
residual norm, which extraction measured over the same texts and stored in the file (so the module carries it).
On SmolLM2 with these 10 layers, ``norm`` 0.05 reads well and text breaks past ~0.1 (``vllm-steer sweep`` shows it).

The server needs ``"capture": ["activations"]`` in its steer block (and the module key, when set):
``python examples/extract_and_steer.py BASE_URL [API_KEY] [OUT.safetensors]``.
The same from the shell: ``vllm-steer extract --server BASE_URL --pairs pairs.jsonl -o joy.safetensors --register joy``.
"""

import sys

from vllm_steer import Client

base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
api_key = sys.argv[2] if len(sys.argv) > 2 else None
out = sys.argv[3] if len(sys.argv) > 3 else "joy.safetensors"

pairs = [
    {"positive": "I love this day, everything is wonderful", "negative": "I hate this day, everything is terrible"},
    {"positive": "What a delightful, happy surprise", "negative": "What a miserable, awful surprise"},
    {"positive": "She smiled with joy at the gift", "negative": "She frowned in anger at the gift"},
    {"positive": "We had a great, cheerful time", "negative": "We had a bad, gloomy time"},
]

with Client(base_url, api_key=api_key) as c:
    layers = c.status().model.num_layers
    found = c.extract(pairs, layers=f"{layers // 5}-{layers // 2}", method="mean_diff")
    print("saved:", found.save(out))
    c.register_module("joy", file=out, replace=True)
    prompt = "Today the weather is bad and I feel"
    for norm in (0.0, 0.05):
        r = c.complete(prompt, module=None if norm == 0 else {"name": "joy", "norm": norm}, max_tokens=12, temperature=0)
        print(f"norm {norm}:", repr(r.text))
    c.delete_module("joy")
