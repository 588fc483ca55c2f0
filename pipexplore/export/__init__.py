"""Code and files out: the code that reproduces a plan (a GPipe, a pipelining split, the torchrun script,
the schedule as CSV), torchtitan's module FQNs, and a stage's weights from a checkpoint."""
