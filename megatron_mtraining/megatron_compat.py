"""A work-around for a megatron-core 0.19 defect that the launcher meets without Transformer Engine or Apex.

Resuming a ``torch_dist`` checkpoint with ``--use-distributed-optimizer`` on torch's Adam (the optimizer
Megatron uses when neither TE nor Apex imports) stops with a bare ``AssertionError`` in
``DistributedOptimizer.state_dict``: it reads the step counter from the Adam state, which torch creates
at the first step, while the loader asks for the state before any step. Megatron fills that state with
its own ``_init_optimizer_states_with_dummy_values`` on its FSDP path; :func:`fill_optimizer_state_before_loading`
does the same before every load on the others. The checkpoint then overwrites every filled value (step,
moments and the fp32 main parameters are all stored), so a resumed run continues the saved one.
"""

from __future__ import annotations

import functools


def fill_optimizer_state_before_loading() -> None:
    """Patch ``DistributedOptimizer.sharded_state_dict`` once, where Megatron runs on torch's Adam."""
    from megatron.core.optimizer import distrib_optimizer

    optimizer_class = distrib_optimizer.DistributedOptimizer
    if distrib_optimizer.HAVE_APEX_OR_TE or getattr(optimizer_class.sharded_state_dict, "fills_state", False):
        return
    stock = optimizer_class.sharded_state_dict

    @functools.wraps(stock)
    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, **options):
        if is_loading and not self.optimizer.state:
            self._init_optimizer_states_with_dummy_values()
        return stock(
            self, {} if model_sharded_state_dict is None else model_sharded_state_dict, is_loading=is_loading, **options
        )

    sharded_state_dict.fills_state = True
    optimizer_class.sharded_state_dict = sharded_state_dict
