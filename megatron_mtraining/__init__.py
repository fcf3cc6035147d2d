"""megatron_mtraining: MTraining (distributed dynamic sparse attention) for Megatron-Core."""

__version__ = "0.1.0.dev0"
