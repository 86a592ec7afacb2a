"""A request leaves no reference cycle of ours in the API process: what it held is freed when it ends, not by
Python's cyclic collector (s41, 8b prefill load on an H200: the capture server's API process ran a generation-2
collection of 22-34 ms about every 256 requests, each freeing ~17,000 objects, all of them held by the response
middleware's self-calling ``send`` wrapper, the refusal watch's wrapped ``put`` and each steered request's wrapped
``_new_request_output``; stock vLLM leaves none).
Checked with the collector off: an object reachable only through a cycle outlives its last plain reference."""

from __future__ import annotations

import asyncio
import gc
import weakref
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from vllm import CompletionOutput, RequestOutput
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector

from vllm_steer.frontend.applied import close_holder, open_holder, record_applied, watch_refusal
from vllm_steer.frontend.applied_output import mark, patch_output_processor_applied
from vllm_steer.server.response_field import SteeringResponseMiddleware


@contextmanager
def collector_off():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class Sink:
    """The server's ``send``: what the middleware's wrapper holds for the whole response."""

    def __init__(self) -> None:
        self.messages: list[dict] = []

    async def __call__(self, message: dict) -> None:
        self.messages.append(message)


def _app(kind: str):
    async def app(scope, receive, send) -> None:
        record_applied("cmpl-1", "k" * 32, "k" * 32, {})  # a steered request: the holder has something to splice
        ctype = b"text/event-stream" if kind == "sse" else b"application/json"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype)]})
        if kind == "sse":
            for body in (b'data: {"id":"cmpl-1","choices":[{"text":"a"}]}\n\n', b"data: [DONE]\n\n"):
                await send({"type": "http.response.body", "body": body, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        else:
            await send({"type": "http.response.body", "body": b'{"id":"cmpl-1","choices":[]}'})
    return app


@pytest.mark.parametrize("kind", ["sse", "json"])
def test_the_response_middleware_frees_a_request_without_the_cyclic_collector(kind):
    """The middleware's ``send`` wrapper calls itself (an SSE start held until the first event): its closure held
    it, so the server's ``send`` (and with it the scope, headers and holder) stayed alive until a collection."""
    loop = asyncio.new_event_loop()
    try:
        with collector_off():
            sink = Sink()
            scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                     "app": SimpleNamespace(state=SimpleNamespace()), "headers": []}

            async def receive() -> dict:
                return {"type": "http.request", "body": b"{}", "more_body": False}

            loop.run_until_complete(SteeringResponseMiddleware(_app(kind))(scope, receive, sink))
            body = b"".join(m.get("body", b"") for m in sink.messages if m["type"] == "http.response.body")
            assert b'"steering"' in body  # the response was spliced: the wrapper did its work
            alive = weakref.ref(sink)
            del sink
            assert alive() is None, "the server's send outlived the request (held by a cycle)"
    finally:
        loop.close()


def test_a_watched_output_collector_is_freed_after_its_last_output():
    """``watch_refusal`` wraps the collector's ``put`` with a closure holding the bound ``put``: unwrapped at the
    finished output, the collector (and the outputs it held) go with the request."""
    with collector_off():
        holder, token = open_holder()
        try:
            collector = RequestOutputCollector(RequestOutputKind.DELTA, "cmpl-1")
            watch_refusal(collector)
            assert "put" in vars(collector)  # watched while the request runs
            done = CompletionOutput(index=0, text="a", token_ids=[5], cumulative_logprob=None, logprobs=None,
                                    finish_reason="length")
            collector.put(RequestOutput("cmpl-1", "p", [5], None, [done], finished=True))
            assert collector.output is not None and collector.output.finished
            alive = weakref.ref(collector)
            del collector
            assert alive() is None, "the collector outlived its request (held by a cycle)"
            assert "refused" not in holder
        finally:
            close_holder(token)


def test_a_steered_requests_output_state_is_freed_when_it_finishes():
    """Each steered request's ``RequestState`` once had its ``_new_request_output`` wrapped by a closure holding the
    bound original: the state (prompt ids, detokenizer, outputs) lived on until a collection. Its outputs still
    carry ``steering``."""
    patch_output_processor_applied()
    params = SamplingParams(max_tokens=1, detokenize=False, output_kind=RequestOutputKind.DELTA)
    applied = {"prefill": "k" * 32, "decode": "k" * 32}
    mark(params, applied)
    request = EngineCoreRequest(request_id="r1", external_req_id="r1", prompt_token_ids=[1, 2, 3], mm_features=None,
                                sampling_params=params, pooling_params=None, arrival_time=0.0, lora_request=None,
                                cache_salt=None, data_parallel_rank=None)
    processor = OutputProcessor(tokenizer=None, log_stats=False)
    queue = RequestOutputCollector(RequestOutputKind.DELTA, "r1")
    with collector_off():
        processor.add_request(request, None, None, 0, queue)
        alive = weakref.ref(processor.request_states["r1"])
        processor.process_outputs([EngineCoreOutput(request_id="r1", new_token_ids=[5],
                                                    finish_reason=FinishReason.LENGTH)])
        assert queue.output.finished and queue.output.steering == applied
        assert "r1" not in processor.request_states
        assert alive() is None, "the request's state outlived it (held by a cycle)"
