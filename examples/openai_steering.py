"""Steer a served model with the official ``openai`` client (packed vectors through ``extra_body``).

Start the server (`./dev serve`), then: ``python examples/openai_steering.py [BASE_URL]``.
Prints the unsteered and the steered completion, and the config hash the server applied.
"""

import sys

import numpy as np
from openai import OpenAI

from vllm_steer import Client, steering_body

base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
client = OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY")
model = client.models.list().data[0].id
sites = Client(base_url).status()["model"]  # hidden size, layers, hooks of the served model
layer = sites["num_layers"] // 2

direction = np.random.default_rng(0).standard_normal(sites["hidden_size"]).astype(np.float32)
direction *= 60.0 / np.linalg.norm(direction)

prompt = "The capital of France is"
plain = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
steered = client.completions.create(
    model=model, prompt=prompt, max_tokens=16, temperature=0,
    extra_body=steering_body({"post_mlp": (direction[None, :], [layer])}),
)
print("unsteered:", repr(plain.choices[0].text))
print("steered:  ", repr(steered.choices[0].text))
print("applied:  ", (steered.model_extra or {}).get("steering"))
