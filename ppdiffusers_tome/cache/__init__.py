"""The step cache (DeepCache-style feature reuse across denoising steps): its settings (:mod:`.config`), its hooks and
entry points (:mod:`.step_cache`), where a model is split into a shallow part that always runs and a deep part that is
reused (:mod:`.layout`), the adaptive rule and the forecast (:mod:`.adaptive`), what a call site keeps (:mod:`.kept`),
the whole-model cache for models whose blocks cannot be reached (:mod:`.whole_model`), and the two static programs it
exports to (:mod:`.export`). Nothing here imports ToMe."""
