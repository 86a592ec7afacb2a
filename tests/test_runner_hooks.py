"""The runner wrappers' order (``runtime.manager.with_after_forward`` / ``with_after_sample``, on V1 and V2 alike): a
step's captured rows are handed on after the runner's own output copy when it samples in ``sample_tokens``, at once
when ``execute_model`` returned the output itself, and a hand-off no ``sample_tokens`` took is made before the next
forward; each launch is told to the capture threads."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_steer.runtime.manager import with_after_forward, with_after_sample


class _Capture:
    """What the wrappers call on ``CaptureRuntime``, recorded in order."""

    def __init__(self, log: list) -> None:
        self.log, self.sample_due = log, False

    def launched(self) -> None:
        self.log.append("launched")

    def after_forward(self, after=None) -> None:
        self.log.append(("hand-off", after))


class _Runner:
    def __init__(self, outputs: list) -> None:
        self.log: list = []
        self.steer_capture, self.steer_stops, self._outputs = _Capture(self.log), None, outputs

    def execute_model(self, scheduler_output):
        self.log.append("forward")
        return self._outputs.pop(0)

    def sample_tokens(self, grammar_output):
        self.log.append("sample")
        return grammar_output


_Runner.execute_model = with_after_forward(_Runner.execute_model)
_Runner.sample_tokens = with_after_sample(_Runner.sample_tokens)


def test_rows_are_handed_on_after_the_runners_output_copy_v2_and_v1():
    v2 = SimpleNamespace(copy_event="v2-output-copy")  # V2's AsyncOutput
    v1 = SimpleNamespace(async_copy_ready_event="v1-output-copy")  # V1's AsyncGPUModelRunnerOutput
    runner = _Runner([None, None])
    runner.execute_model("s0")
    assert runner.log == ["forward", "launched"]  # nothing handed on before the sampler's copy is queued
    assert runner.sample_tokens(v2) is v2
    runner.execute_model("s1")
    runner.sample_tokens(v1)
    assert runner.log == ["forward", "launched", "sample", ("hand-off", "v2-output-copy"),
                          "forward", "launched", "sample", ("hand-off", "v1-output-copy")]
    runner.sample_tokens(v2)  # a sample with no forward before it (nothing of ours pending): nothing
    assert runner.log[-1] == "sample"


def test_an_output_from_execute_model_hands_on_at_once_and_a_pending_hand_off_goes_before_the_next_forward():
    out = SimpleNamespace()
    runner = _Runner([out, None, None])
    assert runner.execute_model("s0") is out  # no sample_tokens follows this one
    assert runner.log == ["forward", "launched", ("hand-off", None)]
    runner.log.clear()
    runner.execute_model("s1")  # its sample_tokens never comes
    runner.execute_model("s2")
    assert runner.log == ["forward", "launched", ("hand-off", None), "forward", "launched"]
    assert runner.steer_capture.sample_due
    pooling = _Runner([None])
    pooling.is_pooling_model = True  # V2 pools after a None without sample_tokens: handed on at once
    pooling.execute_model("s0")
    assert pooling.log == ["forward", "launched", ("hand-off", None)]
