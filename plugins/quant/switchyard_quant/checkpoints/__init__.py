"""Quantized checkpoints: read GPTQ, AWQ and ipex low-precision files into contract records, write GPTQ.

Each reader turns a folder's packed tensors into ``QuantizedWeight`` records in
``uint4_group_asym(group)`` formats (``int32[N, ceil(K/8)]`` packed along K,
float32 scales and uint8 zero points ``[N, groups]``), so an engine that runs
``--quantize int4`` runs these too, unchanged. A layout that cannot be mapped
exactly (act-order, 8 bits, a group size that is no multiple of 32) is
refused with a ``CheckpointError`` naming the file and tensor.

- :mod:`.folder`: the folder's safetensors and config.json, nibble unpacking,
  mapping group sizes onto the format's;
- :mod:`.gptq`, :mod:`.awq`, :mod:`.lowp`: one reader per layout;
- :mod:`.gguf`: the Q4_0 and Q4_1 blocks a folder converted from a GGUF file
  keeps (``switchyard_spec.GGUF_BLOCKS_FILE``), as ``uint4_group_asym(32)``
  and ``uint4_group_min(32)``;
- :mod:`.writer`: ``switchyard quantize`` (RTN into a GPTQ folder).
"""
