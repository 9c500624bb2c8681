"""Reference ZeRO runtime and measurement probes that check zeroplan's predictions against real runs.

Glossary (ZeRO paper, Rajbhandari et al., SC20):
- Ψ (psi): parameters of the model; N_d (nd): data-parallel ranks; rank: one process of the group.
- unit: a group of parameters sharded and communicated together (the root = embeddings and final norm,
  then one unit per transformer block or MLP layer), like an FSDP unit or a DeepSpeed bucket.
- flat buffer: the unit's tensors laid end to end, each padded to a multiple of N_d by
  ``zeroplan.formulas.sharding`` (stage 0: unpadded); rank r owns ``[r*shard, (r+1)*shard)`` of every unit.
- model states: 16-bit parameters and gradients plus the fp32 master copy and Adam m, v.
- units: every size is in elements (``_numel``) until converted once to ``_bytes``.

Only this package imports torch; the planner (``zeroplan``) never does.
"""
