"""The step cache (DeepCache-style feature reuse across denoising steps): its settings and hooks
(:mod:`.step_cache`), where a model is split into a shallow part that always runs and a deep part that is reused
(:mod:`.layout`), and the two static programs it exports to (:mod:`.export`). Nothing here imports ToMe."""
