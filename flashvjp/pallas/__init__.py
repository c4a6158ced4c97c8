"""Pallas forward and backward kernels (in progress)."""
