"""The merge core: tensors in, tensors out; nothing here knows about UNets, pipelines or hooks.

One job per module, in the order a plan is made: :mod:`.runtime` (the kernel family object, tracing),
:mod:`.cache` (device tables), :mod:`.partition` (the one layout type and the random src/dst partition over it),
:mod:`.similarity` (best dst per src), :mod:`.global_plan` (ToMe's plan over the whole grid), :mod:`.windows` and
:mod:`.local_plan` (matching inside windows), :mod:`.feature_order` (windows cut along the features) and
:mod:`.downsample` (ToDo).

Everything a forward runs stays on the device and no Python decision depends on a tensor's value or the batch size,
so the same code runs eagerly and under ``paddle.jit.to_static``, also with a dynamic batch (see ``docs/design.md``
for the rules the traced code follows).
"""
