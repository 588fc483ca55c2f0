"""Workarounds for torch's fx splitter: graph rewrites that let a traced model's stages run.

:func:`pipexplore.models.trace.split` hands every graph torch's tracer captures through these
(its ``split_policy``) before torch splits it into stages. Each rewrite keeps the computation
and names the torch issue it works around; a torch that has no such construct leaves the graph
as it is.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx, nn

__all__ = ["inline_constant_no_grad_regions"]


def inline_constant_no_grad_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """Inline the ``torch.no_grad()`` regions (``wrap_with_set_grad_enabled``) whose inputs need no
    gradient — buffers and integer inputs, like a rotary embedding's ``inv_freq`` and positions.

    torch's splitter files such a region's body under its module twice, apart, and builds a stage
    that cannot run (pytorch/pytorch#184361, every Hugging Face model with RoPE). Without the
    wrapper the graph is the same computation: no gradient could flow through it anyway.
    """
    try:
        from torch._higher_order_ops.wrap import wrap_with_set_grad_enabled
    except ImportError:  # an older torch without the wrapper has nothing to inline
        return gm
    graph = gm.graph
    needs_grad: set[fx.Node] = set()
    changed = False
    for node in list(graph.nodes):
        if node.op == "get_attr":
            try:
                value = operator.attrgetter(str(node.target))(gm)
            except AttributeError:
                value = None
            if isinstance(value, nn.Parameter) and value.requires_grad:
                needs_grad.add(node)
            continue
        if node.op == "placeholder":
            value = node.meta.get("val")
            if value is None or torch.is_tensor(value) and (value.is_floating_point() or value.is_complex()):
                needs_grad.add(node)  # an input of unknown type counts as one that may need a gradient
            continue
        inputs_need_grad = any(n in needs_grad for n in node.all_input_nodes)
        if not (node.op == "call_function" and node.target is wrap_with_set_grad_enabled):
            if inputs_need_grad:
                needs_grad.add(node)
            continue
        enable, body_node, *args = node.args
        if inputs_need_grad and enable is not False:
            needs_grad.add(node)
        body = operator.attrgetter(str(body_node.target))(gm)
        own_weights = [p for p in body.parameters() if p.requires_grad]
        if inputs_need_grad or own_weights:
            continue  # gradients could flow through it: torch's own handling stays
        stack = node.meta.get("nn_module_stack", {})
        env: dict[fx.Node, Any] = {}
        outputs: Any = None
        with graph.inserting_before(node):
            placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
            env.update(zip(placeholders, args))
            for inner in body.graph.nodes:
                if inner.op == "placeholder":
                    continue
                if inner.op == "output":
                    outputs = fx.map_arg(inner.args[0], lambda n: env[n])
                    continue
                if inner.op == "get_attr":
                    name = f"{body_node.target}_{inner.target}".replace(".", "_")
                    setattr(gm, name, operator.attrgetter(str(inner.target))(body))
                    copied = graph.get_attr(name)
                else:
                    copied = graph.node_copy(inner, lambda n: env[n])
                copied.meta = {**inner.meta, "nn_module_stack": stack}
                env[inner] = copied
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(outputs[user.args[1]])
                graph.erase_node(user)
        if node.users:
            node.replace_all_uses_with(outputs)
        graph.erase_node(node)
        if not body_node.users:
            graph.erase_node(body_node)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm
