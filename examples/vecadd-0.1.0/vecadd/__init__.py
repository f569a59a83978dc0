"""Elementwise add of two CUDA tensors: wheelhouse's example extension."""

import torch  # noqa: F401  (loads libtorch and libc10, which the extension links against)

from vecadd._C import add

__all__ = ["add"]
