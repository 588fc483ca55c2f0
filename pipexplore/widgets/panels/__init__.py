"""The explorer's panels, one per family: controls, status, stages (the strip), timelines, runs,
export. Each is built from a complete :class:`~pipexplore.widgets.state.ExplorerState` and
redraws itself on the state's changes (``refresh(change)``)."""
