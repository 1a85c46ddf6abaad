"""Stand-in for MindSpeed-LLM's training loop, for tests/trainings/test_mindspeed_llm.py (never in the package).

MindSpeed-LLM cannot run here (it imports torch_npu, and its training module pulls in much of
MindSpeed and a Megatron-LM 0.12.1 checkout), so this runner reproduces the two facts about it the
guard depends on, in our own code, around Megatron-LM's real loop from the megatron-core wheel (0.17+):

- a module under MindSpeed-LLM's name ``mindspeed_llm.training.training`` binds ``train_step``,
  ``save_checkpoint``, ``save_checkpoint_and_time`` and ``finalize_model_grads`` by name before the
  guard is installed (so the guard has to find them by identity);
- ``megatron.training.training.train`` is replaced by a loop in that module that calls those
  bindings, sets ``args.curr_iteration``, counts iterations and samples itself and never reads
  ``args.iterations_to_skip``.

It prints one line per iteration on rank 0: ``standin-loop iteration N skipped S lr X``.

    torchrun --nproc-per-node 2 tests/standin_mindspeed_llm_loop.py MEGATRON ARGS...
"""

from __future__ import annotations

import sys
import types


def _standin_module() -> types.ModuleType:
    import megatron.training.training as megatron_training
    from megatron.core import mpu
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.training import get_args
    from megatron.training.checkpointing import save_checkpoint

    standin = types.ModuleType("mindspeed_llm.training.training")
    standin.__doc__ = "stand-in: MindSpeed-LLM's training module (bindings by name, its own loop)"
    standin.train_step = megatron_training.train_step
    standin.save_checkpoint = save_checkpoint
    standin.save_checkpoint_and_time = megatron_training.save_checkpoint_and_time
    standin.finalize_model_grads = megatron_training.finalize_model_grads

    def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator,
              valid_data_iterator, process_non_loss_data_func, config, checkpointing_context, *rest, **kw):
        args = get_args()
        config.grad_scale_func = optimizer.scale_loss
        config.timers = megatron_training.get_timers()
        config.finalize_model_grads_func = standin.finalize_model_grads
        forward_backward_func = get_forward_backward_func()
        iteration = args.iteration
        while iteration < args.train_iters:
            args.curr_iteration = iteration
            result = standin.train_step(forward_step_func, train_data_iterator, model, optimizer,
                                        opt_param_scheduler, config, forward_backward_func, iteration=iteration)
            skipped = result[1]
            iteration += 1
            args.consumed_train_samples += (mpu.get_data_parallel_world_size() * args.micro_batch_size
                                            * get_num_microbatches())
            if args.rank == 0:
                print(f"standin-loop iteration {iteration} skipped {int(skipped)} "
                      f"lr {optimizer.param_groups[0]['lr']:.6E}", flush=True)
            if args.save and args.save_interval and iteration % args.save_interval == 0:
                standin.save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler, 0,
                                                 checkpointing_context)
        return iteration, 0

    standin.train = train
    return standin


def main() -> None:
    from megatron_patches.testing import megatron_lm_cpu, pretrain_cpu

    megatron_lm_cpu.install()
    import megatron.training.training as megatron_training

    for name in ("mindspeed_llm", "mindspeed_llm.training"):
        sys.modules[name] = types.ModuleType(name)  # empty stand-in packages above the module
    standin = sys.modules["mindspeed_llm.training.training"] = _standin_module()
    megatron_training.train = standin.train  # MindSpeed-LLM registers its train over Megatron's
    pretrain_cpu.main(sys.argv[1:])  # import megatron_patches.apply, then Megatron's pretrain


if __name__ == "__main__":
    main()
