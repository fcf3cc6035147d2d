"""CPU quickstart: the main job on an embedded default (tiny model, synthetic data).

The Megatron training job lands with the Megatron-integration milestone; until then this prints
what exists and exits 0.
"""

print("megatron-mtraining quickstart: the CPU training demo is coming in a later release "
      "(see README, 'Status'). Run `make test` to exercise what exists today.")
