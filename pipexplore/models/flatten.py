"""``flatten``: a model whose forward is a chain of its children, as an ``nn.Sequential`` for GPipe."""
from __future__ import annotations

from collections import OrderedDict

from torch import fx, nn

__all__ = ["FlattenError", "flatten"]

_TRACING_HINT = ("pipexplore.explore(model, sample) splits models that are not chains by tracing them "
                 "(pipexplore.models.trace), with no flattening needed")


class FlattenError(ValueError):
    """The model's forward is not a chain of its children; the message says where and points to tracing."""


class _ChildrenTracer(fx.Tracer):
    """Symbolic tracing that stops at every submodule: forward as calls of modules and functions."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def _describe(node: fx.Node) -> str:
    if node.op == "call_module":
        return f"child {node.target!r}"
    if node.op == "placeholder":
        return f"input {node.target!r}"
    return f"{node.op} {getattr(node.target, '__name__', node.target)!s} ({node.name})"


def _function_module(model: nn.Module, nodes: list[fx.Node], source: fx.Node) -> fx.GraphModule:
    """The operations between two children (``torch.flatten(x, 1)``, ``x.view(...)``) as one layer."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {source: graph.placeholder("x")}
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[nodes[-1]])
    return fx.GraphModule(model, graph, class_name="Function")


def flatten(model: nn.Module) -> nn.Sequential:
    """Turn a model whose forward is a chain of its children into an ``nn.Sequential``.

    The forward is followed symbolically (``torch.fx``), stopping at each child: every child
    called once, each taking only the previous step's output, becomes a layer under its own name
    (``stem``, ``layer1``, …, ``fc``); operations between children that are not modules
    (``torch.flatten(x, 1)``, ``x.view(x.size(0), -1)``, ``F.relu``) become small layers named
    after the operation. The layers are the model's own children (not copies), so the result
    computes the same outputs and gradients with the same parameters, and gets ``GPipe``, skip
    routes and balancing. Children that forward never calls are left out.

    Raises:
        FlattenError: the forward is not a chain — a value used twice (a residual, a branch),
            several inputs or outputs, a child called twice, a module nested in a child called
            directly, a child's parameter used outside it, or control flow that symbolic tracing
            cannot follow. The message names the place and points to tracing, which splits any
            model: ``pipexplore.explore(model, sample)``.

    Example::

        pipe = GPipe(pipexplore.flatten(resnet), balance=[3, 3], chunks=8)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"flatten takes an nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.Sequential):
        return model
    name = type(model).__name__
    try:
        graph = _ChildrenTracer().trace(model)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FlattenError(f"could not follow {name}.forward as a chain of its children: {type(exc).__name__}: "
                           f"{first}. {_TRACING_HINT}") from exc
    children = dict(model.named_children())
    inputs = [n for n in graph.nodes if n.op == "placeholder" and n.users]
    if len(inputs) != 1:
        raise FlattenError(f"{name}.forward uses {len(inputs)} inputs ({', '.join(str(n.target) for n in inputs)}); "
                           f"an nn.Sequential passes one value from layer to layer. {_TRACING_HINT}")
    output = next(n for n in graph.nodes if n.op == "output")
    if not isinstance(output.args[0], fx.Node):
        raise FlattenError(f"{name}.forward returns {type(output.args[0]).__name__} of several values; an "
                           f"nn.Sequential returns its last layer's output. {_TRACING_HINT}")

    layers: list[tuple[str, nn.Module]] = []
    current = inputs[0]  # the value the chain carries
    pending: list[fx.Node] = []
    called: set[str] = set()

    def close(segment: list[fx.Node], source: fx.Node) -> fx.Node:
        """Check that ``segment`` takes only ``source`` and hands on only its last value."""
        inside = set(segment)
        for node in segment:
            for used in node.all_input_nodes:
                if used not in inside and used is not source and used.op != "get_attr":
                    raise FlattenError(f"{name} is not a chain of its children: {_describe(node)} uses "
                                       f"{_describe(used)}, which is not the previous step's output (a residual or a "
                                       f"branch). {_TRACING_HINT}")
        later = [user for user in source.users if user not in inside]
        if later:
            raise FlattenError(f"{name} is not a chain of its children: {_describe(source)} is used again by "
                               f"{_describe(later[0])} (a residual or a branch). {_TRACING_HINT}")
        for node in segment[:-1]:
            outside = [user for user in node.users if user not in inside]
            if outside:
                raise FlattenError(f"{name} is not a chain of its children: {_describe(node)} is used by "
                                   f"{_describe(outside[0])} as well as by the next step. {_TRACING_HINT}")
        return segment[-1]

    def flush() -> None:
        nonlocal current, pending
        if not pending:
            return
        work = [n for n in pending if n.op != "get_attr"]
        for node in pending:
            if node.op == "get_attr" and str(node.target).split(".")[0] in children:
                raise FlattenError(f"{name}.forward uses {node.target!r}, a parameter of a child, outside that "
                                   f"child: as a layer of an nn.Sequential it would be shared. {_TRACING_HINT}")
        if work:
            last = close(work, current)
            layers.append((work[0].name, _function_module(model, pending, current)))
            current = last
        pending = []

    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op != "call_module":
            pending.append(node)
            continue
        target = str(node.target)
        if target not in children:
            raise FlattenError(f"{name}.forward calls {target!r}, a module inside a child: an nn.Sequential holds "
                               f"the children themselves. {_TRACING_HINT}")
        if target in called:
            raise FlattenError(f"{name}.forward calls child {target!r} more than once: a layer of an nn.Sequential "
                               f"runs once. {_TRACING_HINT}")
        flush()
        if node.kwargs or len(node.args) != 1:
            raise FlattenError(f"{name}.forward calls child {target!r} with {len(node.args)} positional and "
                               f"{len(node.kwargs)} keyword arguments; a layer of an nn.Sequential takes one. "
                               f"{_TRACING_HINT}")
        current = close([node], current)
        called.add(target)
        layers.append((target, children[target]))
    flush()
    if output.args[0] is not current:
        raise FlattenError(f"{name}.forward returns {_describe(output.args[0])}, not the end of the chain. "
                           f"{_TRACING_HINT}")
    if not layers:
        raise FlattenError(f"{name}.forward calls no child: there is nothing to split. {_TRACING_HINT}")
    names: dict[str, int] = {}
    unique: list[tuple[str, nn.Module]] = []
    for layer_name, layer in layers:
        names[layer_name] = names.get(layer_name, 0) + 1
        unique.append((layer_name if names[layer_name] == 1 else f"{layer_name}_{names[layer_name]}", layer))
    sequential = nn.Sequential(OrderedDict(unique))
    sequential.training = model.training  # the children keep their own modes
    return sequential
