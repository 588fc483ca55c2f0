"""Code and files out: the torchrun script, torchtitan's module FQNs."""
