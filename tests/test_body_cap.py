"""The body caps' refusals (``server.request_body``, ``server.modules_routes``): a 413 naming ``body``
as soon as the cap is passed, whether the rest of the body is still coming (read and dropped, so the client reads the
answer) or the message that passed the cap was its last (nothing to drain: no wait at all)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from vllm_steer.server.request_body import SteeringRequestMiddleware

CAP = 1000


def _refuse(messages: list[dict], headers: list | None = None) -> tuple[list[dict], int]:
    """Run the middleware on a body arriving as ``messages`` (then the client only waits: receive
    blocks). Returns what was sent and how many messages were read."""
    read = 0

    async def receive():
        nonlocal read
        if read < len(messages):
            read += 1
            return messages[read - 1]
        await asyncio.Event().wait()  # the client sent everything and waits for the answer

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):  # never reached: the body is refused
        raise AssertionError("the app saw a refused body")

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers or [],
             "app": SimpleNamespace(state=SimpleNamespace(steer_config=SimpleNamespace(body_cap=CAP)))}
    asyncio.run(asyncio.wait_for(SteeringRequestMiddleware(app)(scope, receive, send), 5))
    return sent, read


def _chunk(n: int, more: bool) -> dict:
    return {"type": "http.request", "body": b"x" * n, "more_body": more}


def test_a_body_whose_last_message_passes_the_cap_is_refused_at_once():
    sent, read = _refuse([_chunk(600, True), _chunk(600, False)])  # chunked: no content-length
    assert read == 2 and sent[0]["status"] == 413
    err = json.loads(sent[1]["body"])["error"]
    assert err["param"] == "body" and str(CAP) in err["message"]


def test_the_rest_of_a_body_past_the_cap_is_read_before_the_413():
    sent, read = _refuse([_chunk(600, True), _chunk(600, True), _chunk(600, True), _chunk(10, False)])
    assert read == 4 and sent[0]["status"] == 413


def test_a_declared_length_over_the_cap_is_refused_before_reading():
    sent, read = _refuse([_chunk(600, True), _chunk(600, False)], headers=[(b"content-length", b"1200")])
    assert sent[0]["status"] == 413 and read == 2  # drained (the client sends before it reads)


def test_a_module_registration_whose_last_message_passes_the_cap_needs_no_drain():
    from vllm_steer.server.modules_routes import _capped
    from vllm_steer.server.request_body import BodyTooLarge

    async def read(messages):
        it = iter(messages)

        async def receive():
            return next(it)

        capped = _capped(receive, CAP)
        try:
            while (await capped()).get("more_body"):
                pass
        except BodyTooLarge as e:
            return e.whole
        return None

    assert asyncio.run(read([_chunk(600, True), _chunk(600, False)])) is True  # nothing left to read
    assert asyncio.run(read([_chunk(600, True), _chunk(600, True), _chunk(10, False)])) is False  # drain the rest
    assert asyncio.run(read([_chunk(600, True), _chunk(300, False)])) is None  # under the cap: read whole
