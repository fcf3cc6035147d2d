"""Megatron-LM-style entry script for MTraining: ``torchrun ... examples/pretrain_mtraining.py <flags>``.

The same as ``python -m megatron_mtraining.pretrain``: every Megatron pretraining flag plus the
``--mtraining-*`` flags (``--help`` lists them under "MTraining").
"""

from megatron_mtraining.pretrain import main

if __name__ == "__main__":
    main()
