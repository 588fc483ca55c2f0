"""The tests' transformer and torchrun hooks: the package's examples (kept as a module name the
exported script can import)."""
from pipexplore.examples import (BranchyTransformer as Branchy, TinyTransformer, build_model,  # noqa: F401
                                 get_batch, loss_fn)
