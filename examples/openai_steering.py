"""Steer a served model with the official ``openai`` client (packed vectors through ``extra_body``).

Start the server (`./dev serve`), then: ``python examples/openai_steering.py [BASE_URL]``, where BASE_URL is
the server (``http://127.0.0.1:8000``) or its OpenAI base (``http://127.0.0.1:8000/v1``): both work.
Prints the unsteered and the steered completion, and the config hash the server applied.
"""

import sys

import numpy as np


def server_url(argv: list[str]) -> str:
    """The server's root URL from the command line: a trailing ``/v1`` (the OpenAI base URL) or ``/`` is dropped."""
    url = (argv[1] if len(argv) > 1 else "http://127.0.0.1:8000").rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def main() -> None:
    from openai import OpenAI

    from vllm_steer import Client, steering_body

    base_url = server_url(sys.argv)
    client = OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY")
    model = client.models.list().data[0].id
    sites = Client(base_url).status().model  # hidden size, layers, hooks of the served model
    layer = sites.num_layers // 2

    direction = np.random.default_rng(0).standard_normal(sites.hidden_size).astype(np.float32)
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


if __name__ == "__main__":
    main()
