"""Compiled kernels attached to a model from outside; the model keeps the eager reference as the body."""
