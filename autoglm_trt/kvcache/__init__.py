"""The paged KV cache on the host: its layout (``layout``), the block pool with its prefix cache
(``block_pool``), the per-layer pools in host memory (``host_pools``) and the graph inputs of a
step (``step_inputs``). Numpy, its pools named as the graph names them (``graph.names``); the export's
validation, the backends and the runtime share it.
"""
