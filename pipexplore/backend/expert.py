"""ExpertBackend: serve a module's forward and backward (with an optimizer step) through TaskPools."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from pipexplore.backend.schema import BatchTensorProto, nested_flatten, nested_map, nested_pack
from pipexplore.backend.task_pool import TaskPool

__all__ = ["ExpertBackend"]


class ExpertBackend:
    """A module served to many callers, hivemind-style.

    ``forward(*flat_inputs)`` runs under ``no_grad``. ``backward(*flat_inputs, *output_grads)``
    runs forward again with grad enabled on detached inputs, back-propagates the given output
    gradients, steps and zeroes the optimizer, and returns the input gradients (zeros where an
    input got none). A backward that raises steps nothing and leaves no gradient behind. Callers
    reach both through :attr:`forward_pool` and :attr:`backward_pool`, which batch their tasks.

    Example::

        backend = ExpertBackend("ffn", nn.Linear(8, 8), torch.optim.SGD(ffn.parameters(), lr=0.1),
                                args_schema=(BatchTensorProto(8),), max_batch_size=256)
        with Runtime({"ffn": backend}):
            (y,) = backend.forward_pool.submit_task(x).result()
    """

    def __init__(self, name: str, expert: nn.Module, optimizer: Optional[torch.optim.Optimizer], *,
                 args_schema: Optional[tuple[Any, ...]] = None, kwargs_schema: Optional[dict[str, Any]] = None,
                 outputs_schema: Any = None, max_batch_size: int = 1024, **pool_options: Any) -> None:
        if args_schema is None and kwargs_schema is None:
            raise ValueError(f"ExpertBackend '{name}' needs an input schema: args_schema=(BatchTensorProto(...),) "
                             "and/or kwargs_schema={...}")
        self.name = name
        self.expert = expert
        self.optimizer = optimizer
        self.args_schema = tuple(args_schema or ())
        self.kwargs_schema = dict(kwargs_schema or {})
        self.max_batch_size = max_batch_size
        self.forward_schema = (self.args_schema, self.kwargs_schema)
        self._flat_inputs = list(nested_flatten(self.forward_schema))
        for proto in self._flat_inputs:
            if not isinstance(proto, BatchTensorProto):
                raise TypeError(f"schemas hold BatchTensorProto leaves, got {type(proto).__name__}")
        if outputs_schema is None:
            outputs_schema = self._infer_outputs_schema()
        self.outputs_schema = outputs_schema
        self._flat_outputs = list(nested_flatten(outputs_schema))
        grad_schema = [BatchTensorProto(*p.shape, dtype=p.dtype) for p in self._flat_outputs]
        self.forward_pool = TaskPool(self.forward, max_batch_size, name=f"{name}_forward",
                                     schema=self._flat_inputs, **pool_options)
        self.backward_pool = TaskPool(self.backward, max_batch_size, name=f"{name}_backward",
                                      schema=self._flat_inputs + grad_schema, **pool_options)

    @property
    def device(self) -> torch.device:
        param = next(self.expert.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def _infer_outputs_schema(self) -> Any:
        dummy = [proto.make_empty(0, self.device) for proto in self._flat_inputs]
        with torch.no_grad():
            outputs = self._call(dummy)
        return nested_map(lambda t: BatchTensorProto.from_tensor(t), outputs)

    def _call(self, flat_inputs: list[torch.Tensor]) -> Any:
        args, kwargs = nested_pack(flat_inputs, self.forward_schema)
        return self.expert(*args, **kwargs)

    def forward(self, *flat_inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        device = self.device
        with torch.no_grad():
            outputs = self._call([x.to(device) for x in flat_inputs])
        return tuple(nested_flatten(outputs))

    def backward(self, *flat_inputs_and_grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = len(self._flat_inputs)
        device = self.device
        inputs = [x.detach().to(device) for x in flat_inputs_and_grads[:n]]
        grads = flat_inputs_and_grads[n:]
        inputs = [x.requires_grad_(proto.requires_grad or x.is_floating_point())
                  for x, proto in zip(inputs, self._flat_inputs)]
        params = [p for p in self.expert.parameters() if p.requires_grad]
        wanted = [x for x in inputs if x.requires_grad] + params
        # Computed apart and accumulated only once the whole batch succeeded: a batch that raises
        # leaves no partial gradient behind (its tasks are then retried apart).
        with torch.enable_grad():
            outputs = list(nested_flatten(self._call(inputs)))
            pairs = [(y, g.to(device=y.device, dtype=y.dtype)) for y, g in zip(outputs, grads) if y.requires_grad]
            computed: Sequence[Optional[torch.Tensor]] = [None] * len(wanted)
            if pairs and wanted:
                computed = torch.autograd.grad([y for y, _ in pairs], wanted, [g for _, g in pairs],
                                               allow_unused=True)
        found = dict(zip(map(id, wanted), computed))
        for param in params:
            grad = found[id(param)]
            if grad is not None:
                param.grad = grad if param.grad is None else param.grad + grad
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return tuple(g if (g := found.get(id(x))) is not None else torch.zeros_like(x) for x in inputs)

    def get_info(self) -> dict[str, Any]:
        return {"name": self.name, "args_schema": self.args_schema, "kwargs_schema": self.kwargs_schema,
                "outputs_schema": self.outputs_schema, "keyword_names": sorted(self.kwargs_schema),
                "max_batch_size": self.max_batch_size}
