"""The engine: continuous batching over the dense model, with no Ray in it. It runs in process
(tests, benches) and inside the Ingress deployment the same way.

Read it in this order: `request` (what a request asks for, what it got, where it stands),
`scheduler` (which tokens run this step, and what a step's sampled tokens do to each request),
`runner` (a step plan run on the model: the one place that touches the device), `engine` (the
thread that steps: schedule -> run -> update, and hands the outputs to the event loop).
"""

from moe_workers.engine.engine import Engine
from moe_workers.engine.request import FinishReason, GenerationRequest, Output, RequestStatus, ending_ids
from moe_workers.engine.runner import ModelRunner, StepTimings, split_chunks
from moe_workers.engine.scheduler import Observer, Overloaded, Scheduler, StepPlan

__all__ = ["Engine", "FinishReason", "GenerationRequest", "ModelRunner", "Observer", "Output", "Overloaded",
           "RequestStatus", "Scheduler", "StepPlan", "StepTimings", "ending_ids", "split_chunks"]
