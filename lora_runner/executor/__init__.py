"""The executor layer: how the engine's steps reach the model, in this process or in one worker per rank.

``UniProcExecutor`` wraps a ModelRunner in the engine's process (tensor_parallel_size=1, today's path);
``MultiprocExecutor`` runs ``tensor_parallel_size`` worker processes joined in a torch.distributed group and
hands each step to all of them as one message (lora_runner.executor.step_message); ``RayExecutor``
(lora_runner.executor.ray_executor, imported on its own: Ray is optional) does the same with one Ray actor
per rank in a placement group.
"""

from lora_runner.executor.base import Executor
from lora_runner.executor.errors import EngineDeadError
from lora_runner.executor.multiproc import MultiprocExecutor
from lora_runner.executor.uniproc import UniProcExecutor
from lora_runner.executor.worker_spec import WorkerSpec

__all__ = ["EngineDeadError", "Executor", "MultiprocExecutor", "UniProcExecutor", "WorkerSpec"]
