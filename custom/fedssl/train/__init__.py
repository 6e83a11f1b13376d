"""Local trainers: each site-side method as a :class:`fedssl.core.trainer.LocalTrainer` built from the site's
data and the method's settings (core math + data + models; no FLARE import)."""
