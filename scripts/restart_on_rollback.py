#!/usr/bin/env python3
"""The restart launcher from a checkout: the same as ``megatron-patches launch`` (the console
script the wheel installs; ``megatron_patches/launch.py`` holds the logic).

    python scripts/restart_on_rollback.py --max-restarts 3 -- torchrun ... pretrain_gpt.py ...
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's package

from megatron_patches.launch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog=os.path.basename(sys.argv[0])))
