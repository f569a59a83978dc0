"""wheelhouse's example CUDA extension: one kernel, small enough to build in minutes."""

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

setup(
    name="vecadd",
    version="0.1.0",
    packages=["vecadd"],
    ext_modules=[CUDAExtension("vecadd._C", ["csrc/bindings.cpp", "csrc/add.cu"])],
    cmdclass={"build_ext": BuildExtension},
)
