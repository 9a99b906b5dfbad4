"""Mechanics shared by every family: rotary kernels (and, later, varlen and sequence parallel)."""
