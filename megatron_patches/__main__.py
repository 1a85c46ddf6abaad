"""``python -m megatron_patches`` runs the ``megatron-patches`` command."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
