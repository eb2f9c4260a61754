"""Compute kernels used by model/: one folder per operator (see kernels/lightning/)."""
