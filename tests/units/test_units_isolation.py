"""What keeps the tests independent of their order (issue 60 item 4): Megatron's globals reset around
every test (conftest's ``megatron_globals``), and the one shuffled order CI runs
(``MEGATRON_PATCHES_TEST_SEED``)."""

from types import SimpleNamespace

import pytest

from conftest import ORDER_SEED, order_seed, reset_megatron_globals, shuffled


def test_the_reset_clears_the_rerun_machine_and_the_microbatch_calculator_megatron_left_set():
    rerun = pytest.importorskip("megatron.core.rerun_state_machine")
    from megatron.core import num_microbatches_calculator as microbatches

    rerun.get_rerun_state_machine()  # Megatron makes one implicitly: what the variant tests left behind
    microbatches.init_num_microbatches_calculator(0, None, 8, 2, 1)
    assert rerun._GLOBAL_RERUN_STATE_MACHINE is not None and microbatches.get_num_microbatches() == 4
    done = reset_megatron_globals()
    assert "megatron.core.rerun_state_machine.destroy_rerun_state_machine" in done
    assert rerun._GLOBAL_RERUN_STATE_MACHINE is None
    assert microbatches._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None


def _items(layout: dict) -> list:
    return [SimpleNamespace(nodeid=f"{module}::{test}") for module, tests in layout.items() for test in tests]


def test_the_shuffled_order_is_the_seeds_keeps_each_module_together_and_loses_no_test():
    items = _items({f"tests/units/test_{m}.py": [f"test_{m}{i}" for i in range(6)] for m in "abcdefgh"})
    first = [i.nodeid for i in shuffled(items, 11)]
    assert first == [i.nodeid for i in shuffled(items, 11)]  # the seed reruns the order
    assert first != [i.nodeid for i in shuffled(items, 12)] and first != [i.nodeid for i in items]
    assert sorted(first) == sorted(i.nodeid for i in items)
    modules = [nodeid.split("::")[0] for nodeid in first]
    runs = [m for k, m in enumerate(modules) if k == 0 or modules[k - 1] != m]
    assert len(runs) == len(set(modules)) == 8  # each module's tests run one after another


def test_the_seed_is_an_integer_or_random_and_a_wrong_one_is_one_line():
    assert order_seed("") is None and order_seed("42") == 42 and isinstance(order_seed("random"), int)
    with pytest.raises(pytest.UsageError, match=f"{ORDER_SEED} must be an integer seed or 'random', got 'often'"):
        order_seed("often")
