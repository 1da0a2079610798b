"""Kernel sources for mlxinfer's fused attention (read as package data by mlxinfer.kernels)."""
