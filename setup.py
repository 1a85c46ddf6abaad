"""Packaging for megatron_patches.

Runtime needs: megatron-core (the optimizer being guarded), torch, pyyaml, wrapt (wrappers
that keep descriptors and ``__wrapped__``). torch_npu comes with the ``npu`` extra; NVIDIA
apex is used when importable but is never listed: the registry package named ``apex`` is an
unrelated project and the real one is built from source.
"""

from setuptools import find_packages, setup

setup(
    name="megatron_patches",
    version="0.1.0",
    description="Gradient NaN/Inf/explosion detection, diagnosis and recovery for Megatron-LM's optimizer",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_patches", "megatron_patches.*"]),
    python_requires=">=3.10",
    install_requires=[
        # The patch registry declares the same range per target; 0.16.1 is the release tested here.
        "megatron-core>=0.12,<0.17",
        "torch>=2.3",
        "pyyaml>=6",
        "wrapt>=1.14",
        # megatron-core's dist_checkpointing hangs on save without psutil.
        "psutil",
    ],
    extras_require={
        "npu": ["torch_npu"],
        # The report plot and TensorBoard paths are tested in CI too.
        "test": ["pytest>=7", "matplotlib", "tensorboard"],
        "plot": ["matplotlib"],
        "tensorboard": ["tensorboard"],
    },
    entry_points={"console_scripts": ["megatron-patches=megatron_patches.cli:main"]},
)
