"""Packaging for megatron_patches.

Runtime needs: megatron-core (the optimizer being guarded), torch, pyyaml, wrapt (wrappers
that keep descriptors and ``__wrapped__``). torch_npu comes with the ``npu`` extra; NVIDIA
apex is used when importable but is never listed: the registry package named ``apex`` is an
unrelated project and the real one is built from source.
"""

from setuptools import find_packages, setup

# What Megatron-LM's training code (a checkout's pretrain_gpt.py, or the megatron/training that
# megatron-core 0.17+ ships) imports beyond megatron-core's own requirements on a CPU-only runner,
# found by running it: triton is imported even when no kernel of it runs.
MEGATRON_LM_IMPORTS = ["six", "regex", "pydantic", "triton"]

setup(
    name="megatron_patches",
    version="0.1.0",
    description="Gradient NaN/Inf/explosion detection, diagnosis and recovery for Megatron-LM's optimizer",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    # megatron_patches/testing (the CPU runtime and the tiny-GPT harness) is the repository's test
    # vehicle, not the product: the wheel leaves it out; `pip install -e .` (make install) keeps
    # it importable from the checkout.
    packages=find_packages(include=["megatron_patches", "megatron_patches.*"],
                           exclude=["megatron_patches.testing", "megatron_patches.testing.*"]),
    python_requires=">=3.11",  # enum.StrEnum
    install_requires=[
        # The registry's supported range: 0.12.x to 0.19.x and main (0.20). pip picks the newest
        # release the running Python can install: 0.16.1 on 3.11, 0.19.x on 3.12+.
        "megatron-core>=0.12,<0.21",
        "torch>=2.3",
        "pyyaml>=6",
        "wrapt>=1.14",
        # megatron-core's dist_checkpointing hangs on save without psutil.
        "psutil",
    ],
    extras_require={
        "npu": ["torch_npu"],
        "megatron-lm": MEGATRON_LM_IMPORTS,
        # The report plot, TensorBoard, W&B (offline) and Megatron-LM loop paths are tested in CI too.
        # einops: megatron-core's Megatron-FSDP imports it (tests/trainings/test_variant_loops.py).
        "test": ["pytest>=7", "matplotlib", "tensorboard", "wandb", "einops", *MEGATRON_LM_IMPORTS],
        "plot": ["matplotlib"],
        "tensorboard": ["tensorboard"],
        # Megatron-Bridge's loop (Python 3.12 only; tests/trainings/test_bridge.py, docs/bridge.md). Its wheel
        # requires fast-hadamard-transform, an sdist built with nvcc: on a CPU-only machine follow
        # docs/bridge.md instead of installing this extra.
        "bridge": ["megatron-bridge>=0.6.2,<0.7"],
    },
    entry_points={"console_scripts": ["megatron-patches=megatron_patches.cli:main"]},
)
