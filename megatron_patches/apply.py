"""``import megatron_patches.apply``: the one-line opt-in at the top of pretrain_gpt.py.

Reads the YAML named by $MEGATRON_PATCHES_CONFIG (defaults when unset), validates it and
installs the patches. A bad config stops the job here, before any training starts: exit code 2
on every rank, one line on rank 0.
"""

from .runtime import install_from_environment

monitor = install_from_environment()
