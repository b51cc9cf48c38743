"""Rows and optimizer state as raw bit patterns: what a parity XORs, so that nothing is rounded."""

from __future__ import annotations

import numpy as np
import torch

BITS = np.uint32  # a float32's bit pattern


def row_bits(rows: torch.Tensor | np.ndarray, state: torch.Tensor | np.ndarray) -> np.ndarray:
    """Rows ``[n, dim]`` and their optimizer state ``[n, state_width]`` as one matrix of raw bit patterns."""
    rows, state = (np.ascontiguousarray(x.numpy() if isinstance(x, torch.Tensor) else x, dtype=np.float32)
                   for x in (rows, state))
    return np.concatenate([_matrix(rows).view(BITS), _matrix(state).view(BITS)], axis=1)


def _matrix(values: np.ndarray) -> np.ndarray:
    """``[n, width]``, also for no rows or no state (numpy cannot infer a -1 from a size of 0)."""
    return values if values.ndim == 2 else values.reshape(len(values), -1)


def from_bits(bits: np.ndarray, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``row_bits`` undone: rows and state as float32 tensors."""
    values = np.ascontiguousarray(bits).view(np.float32)
    return torch.from_numpy(values[:, :dim].copy()), torch.from_numpy(values[:, dim:].copy())
