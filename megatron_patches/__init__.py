"""megatron_patches: guards Megatron-LM's optimizer step against bad gradients.

Importing this package changes nothing. The opt-in is ``import megatron_patches.apply``
(reads ``MEGATRON_PATCHES_CONFIG``, installs the patches) or the source patch applied by
``make patch``.
"""

__version__ = "0.1.0"
