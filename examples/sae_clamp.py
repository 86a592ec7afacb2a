"""Clamp SAE features: one request sets two features of a configured SAE, the answer says what ran.

``python examples/sae_clamp.py BASE_URL SAE_NAME [FEATURE ...]`` (SAEs: ``GET /v1/steering/sae``).
"""

import sys

from vllm_steer import Client

base_url, sae = sys.argv[1], sys.argv[2]
features = [int(f) for f in sys.argv[3:]] or [3, 17]

with Client(base_url) as c:
    info = c.sae(sae)
    print("sae:", {"name": info.name, "source": info.source, "sites": info.sites})
    prompt = "The capital of France is"
    plain = c.complete(prompt, max_tokens=12, temperature=0)
    clamped = c.complete(prompt, max_tokens=12, temperature=0,
                         sae={"name": sae, "clamps": [{"feature": f, "kind": "set", "value": 40.0} for f in features]})
    print("unclamped:", repr(plain.text))
    print("clamped:  ", repr(clamped.text))
    print("applied:  ", clamped.steering.as_dict())
