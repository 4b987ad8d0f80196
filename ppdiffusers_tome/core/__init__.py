"""What every technique shares: the one hook registry on a layer (:mod:`.registry`), a model's call tracking
(:mod:`.calls`) and its denoising-step clock (:mod:`.generation`), which models of a pipeline a technique attaches to
(:mod:`.targets`) and the checks both configs use on their settings (:mod:`.validation`). Nothing here imports a
technique."""
