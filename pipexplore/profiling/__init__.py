"""Profiling: layers timed on the devices here, the one place the layer table's measured costs come from.

============================  ================================================================
``sequential.py``             ``profile()``: each layer of an ``nn.Sequential`` timed, the layer
                              table; ``backward_split``
``timing.py``                 timers that wait for the device (and can flush its caches first),
                              spreads, lines fitted to costs at several micro-batch sizes
``ratios.py``                 a layer's slowdown beside a twin thread, its forward without
                              autograd, its backward split into input and weight gradients
``calibration.py``            a profile's layers scaled to the whole model (``fresh_grads``)
``optimizer_step.py``         the ``optimizer`` column: an optimizer step timed per layer
============================  ================================================================

It sits in the predict layer and imports nothing of ``predict/``: the cost model, the roofline
(``predict/planned_optimizer.py``) and ``balance_by_time`` read it. The profiles that need a
model's structure build on it from ``models/``: :func:`pipexplore.models.profile.profile_model`
(the one entry, picking planned, meta, traced or sequential), ``models/blockwise.py`` (a model
bigger than one device, block by block) and ``models/trace/profile_candidates.py`` (a traced model's candidate
blocks timed where they run).
"""
