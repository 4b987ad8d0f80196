"""Token merging (ToMe) and token downsampling (ToDo) on a model's transformer blocks: the settings
(:mod:`.config`; ToDo's in :mod:`.todo`), what a block call does (:mod:`.decision`, with the kernel-aware
:mod:`.policy`, both answering with :mod:`.actions`' constants), which plan it gets
(:mod:`.planner`, over the merge core in :mod:`ppdiffusers_tome.ops`), the per-call state (:mod:`.state`), the hooks
that run it (:mod:`.hooks`), installing and removing them (:mod:`.patch`), gradient checkpointing (:mod:`.checkpoint`)
and SD3's joint attention under ToDo (:mod:`.joint_attention`). Nothing here imports the step cache."""
