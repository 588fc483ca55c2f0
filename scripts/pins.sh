# What pyproject.toml's extras cannot say, read by scripts/setup.sh and scripts/lock.sh:
# the CPU wheel of torch, pinned (a loose `torch` would pull a multi-GB CUDA build), and torchtitan,
# whose config dataclasses and parsing rules check the exported torchtitan command
# (tests/test_torchtitan_export.py), installed without its training dependencies (datasets, wandb,
# triton kernels), which that check does not need.
TORCH_PIN="torch==2.13.0"
TORCHTITAN="torchtitan"
# The lock: exact versions of everything the suite imports (make lock writes it).
LOCK=requirements/test.lock
