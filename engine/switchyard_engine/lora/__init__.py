"""LoRA adapters on a base model: reading PEFT folders, holding them, applying them per row.

- :mod:`.config`: ``adapter_config.json`` read and checked (what the engine refuses, and why);
- :mod:`.folder`: the folder's weights read into per-module A and B matrices;
- :mod:`.bank`: the adapters an engine knows, the ones held in memory (an LRU);
- :mod:`.grouped`: the per-row low-rank product over a fused projection's output.

Torch is imported by the submodules that need it, not here.
"""
