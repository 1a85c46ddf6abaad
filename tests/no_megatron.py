"""A pytest plugin (``-p no_megatron``) that makes every ``megatron`` and ``mindspeed`` module
unimportable, as on a machine that has neither: the core's unit tests run under it
(``tests/units/test_units_imports.py``), the tests that need Megatron skip themselves."""

import sys


class _Unimportable:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("megatron", "mindspeed"):
            raise ImportError(f"{name} is made unimportable by tests/no_megatron.py")
        return None


sys.meta_path.insert(0, _Unimportable())
