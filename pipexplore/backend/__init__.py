"""Expert backends: serve modules to many callers, batching their forward and backward tasks."""
from pipexplore.backend.client import BackendPipeline
from pipexplore.backend.expert import ExpertBackend
from pipexplore.backend.runtime import BATCH_COLUMNS, Runtime
from pipexplore.backend.schema import BatchTensorProto, nested_flatten, nested_map, nested_pack
from pipexplore.backend.task_pool import TaskPool

__all__ = ["BatchTensorProto", "ExpertBackend", "TaskPool", "Runtime", "BackendPipeline", "BATCH_COLUMNS",
           "nested_flatten", "nested_pack", "nested_map"]
