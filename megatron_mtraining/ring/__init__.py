"""The context-parallel layer: ``torch.distributed`` and one-device kernels, no Megatron and no flag names.

``groups`` (flat or hierarchical ring process groups), ``comm`` (the asynchronous ring exchange), ``driver``
(the one ring schedule), ``sparse_ring`` and ``dense_ring`` (the attentions run on it), ``estimation`` and
``estimation_comm`` (the index estimated over a CP group), ``consensus`` (every rank agrees on its inputs
before the first collective).
"""
